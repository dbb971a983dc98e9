"""Recipes: the one description of a merge (method, its parameters, and the layer map when it uses one).

    r = Recipe(plan=Plan(b=2, u=1, tb=1, tu=1))                  # layer swapping
    r = Recipe(MethodConfig("ties", density=0.2))                 # a baseline: no layer map
    r = Recipe.load("recipe.yaml"); r.dump("recipe.json")         # YAML or JSON files
    r = Recipe.from_values(method="soup", weight=0.3)             # loose CLI / UI values

As a file (YAML; JSON holds the same keys)::

    method: layer_swap            # or {name: ties, density: 0.2, lam: 1.0}
    plan: {b: 2, u: 1, tb: 1, tu: 1, transition: flat, revert: [4]}

Layer swapping needs a plan; the other methods (soup, task arithmetic, TIES, DARE) take none and
refuse one. Every function that merges (`merging.export_merge`, `merging.merge_in_memory`,
`interop.mergekit_config`, `Workbench.build`, the sweeps) takes a Recipe; a bare `Plan` there
means layer swapping with that map (`as_recipe`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerswap.core.errors import UserError
from layerswap.recipe.fields import FIELDS, PLAN_FILE_KEYS, read_values
from layerswap.recipe.methods import METHODS, MethodConfig
from layerswap.recipe.plans import Plan, default_plan, format_layers

GIVE_BASE = "pass --base (the model both experts were fine-tuned from)"  # what to do, where a command merges


@dataclass(frozen=True)
class Recipe:
    """A merge: `method` (name and parameters) and, for methods that use one, the layer map `plan`."""

    method: MethodConfig = MethodConfig()
    plan: Plan | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.method, MethodConfig):
            raise UserError(f"A recipe's method is a MethodConfig (got {type(self.method).__name__}).")
        if self.plan is not None and not isinstance(self.plan, Plan):
            raise UserError(f"A recipe's plan is a Plan (got {type(self.plan).__name__}).")
        spec = self.method.spec  # unknown method names are refused here
        if spec.uses_plan and self.plan is None:
            raise UserError(f"{spec.title} needs a layer map: give a plan, e.g. plan: {{b: 2, u: 1, tb: 1, tu: 1}}.")
        if not spec.uses_plan and self.plan is not None:
            raise UserError(f"{spec.title} works on every tensor alike and takes no layer map: drop the plan "
                            f"(or use method layer_swap).")

    # ---- what it needs and does ---------------------------------------------------------------
    @property
    def needs_base(self) -> bool:
        """Task-vector methods, and plans that revert layers, read the base model."""
        return self.method.spec.needs_base or bool(self.plan is not None and self.plan.revert)

    def base_reason(self) -> str:
        """Why this recipe needs the base (for error messages)."""
        if self.method.spec.needs_base:
            return f"{self.method.spec.title} works on task vectors (expert minus base)"
        return f"the plan reverts layer{'s' if len(self.plan.revert) > 1 else ''} {format_layers(self.plan.revert)} " \
               "to the base model"

    def require_base(self, have_base: bool, fix: str = GIVE_BASE) -> None:
        """The one refusal of a merge without the base it needs: why it needs it (`base_reason`), and `fix`."""
        if self.needs_base and not have_base:
            raise UserError(f"{self.base_reason()}: {fix}.")

    def validate(self, num_layers: int | None = None) -> None:
        """Raise UserError when a parameter is out of range (and, given `num_layers`, when the plan does not fit)."""
        self.method.validate()
        if self.plan is not None and num_layers is not None:
            self.plan.validate(num_layers)

    def layer_weights(self, num_layers: int) -> list[float] | None:
        """The plan's ``w_lang`` per layer (validated), or None for methods without a plan."""
        self.validate(num_layers)
        return self.plan.layer_weights(num_layers) if self.plan is not None else None

    def title(self) -> str:
        return self.plan.title() if self.plan is not None else self.method.describe()

    # ---- dicts and files ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d: dict[str, Any] = {"method": self.method.to_dict()}
        if self.plan is not None:
            d["plan"] = self.plan.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "recipe") -> "Recipe":
        """From ``{method: NAME | {name: NAME, PARAM: VALUE...}, plan: {...}}``; unknown keys are refused."""
        if not isinstance(d, dict):
            raise UserError(f"{where}: a recipe is a mapping with 'method' and/or 'plan' (got {type(d).__name__}).")
        refuse_unknown(d, ("method", "plan"), where, "a recipe has 'method' and 'plan'")
        method = _method_from(d.get("method", "layer_swap"), where)
        plan = None
        if d.get("plan") is not None:
            plan = _plan_from(d["plan"], where)
        elif method.spec.uses_plan:
            raise UserError(f"{where}: {method.spec.title} needs a plan, e.g. plan: {{b: 2, u: 1, tb: 1, tu: 1}}.")
        return cls(method, plan)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Recipe":
        """A recipe from a YAML (.yaml/.yml) or JSON file."""
        return cls.from_dict(read_data_file(path), where=str(path))

    def dump(self, path: str | os.PathLike | None = None) -> str:
        """The recipe as YAML text (JSON when `path` ends in .json); written to `path` when given."""
        if path is not None and str(path).lower().endswith(".json"):
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        else:
            import yaml

            text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    # ---- from loose values (CLI flags, app controls) ------------------------------------------------
    @classmethod
    def from_values(cls, *, num_layers: int | None = None, defaults: Plan | None = None, **values: Any) -> "Recipe":
        """A recipe from loose values as the CLI and the app hold them (strings, floats from sliders, None
        for "not given"), by `layerswap.recipe.fields` name (b, u, tb, tu, transition, transition_weight, non_layer,
        kind, layer_weights, k, seed, offset, modules, revert, method, weight, lam, density, drop_rate,
        expert_weights), each read and bounded by its field. Missing b/u/tb/tu and transition values take those of
        `defaults` (the models' opening plan), else `default_plan(num_layers)` (the literature's setting,
        scaled); layer weights alone imply ``kind: weights``; the seed serves the
        random map and DARE alike. Parameters of the other part (plan values for a soup) are ignored, as the
        app keeps every control."""
        v = read_values(values, num_layers)
        name = v.get("method") or "layer_swap"
        mc = MethodConfig(name=name, **{f.method: v[f.name] for f in FIELDS if f.method and v.get(f.name) is not None})
        mc.validate()
        if not mc.spec.uses_plan:
            return cls(mc)
        d = defaults or (default_plan(num_layers) if num_layers else Plan())
        kind = v.get("kind") or ("weights" if v.get("layer_weights") is not None else "swap")
        given = {f.plan: v[f.name] for f in FIELDS if f.plan and v.get(f.name) is not None}
        given.update(kind=kind, weights=given.get("weights") if kind == "weights" else None)
        opening = ("b", "u", "tb", "tu", "transition", "transition_weight", "non_layer")
        plan = Plan(**{**{c: getattr(d, c) for c in opening}, **given})
        r = cls(mc, plan)
        if num_layers:
            r.validate(num_layers)
        return r


def as_recipe(x: "Recipe | Plan") -> Recipe:
    """A Recipe as is; a bare Plan as layer swapping with that map."""
    if isinstance(x, Recipe):
        return x
    if isinstance(x, Plan):
        return Recipe(plan=x)
    raise UserError(f"Expected a Recipe (or a Plan for layer swapping), got {type(x).__name__}.")


def read_data_file(path: str | os.PathLike) -> Any:
    """Parsed YAML or JSON, with a one-line error naming the file and the problem."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{path}: no such file.")
    text = p.read_text(encoding="utf-8")
    if p.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not valid JSON (line {e.lineno}: {e.msg}).") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"line {mark.line + 1}: " if mark is not None else ""
        raise UserError(f"{path}: not valid YAML ({at}{getattr(e, 'problem', None) or e}).") from None


def _method_from(m: Any, where: str) -> MethodConfig:
    if isinstance(m, str):
        m = {"name": m}
    if not isinstance(m, dict) or not isinstance(m.get("name"), str):
        raise UserError(f"{where}: method is a name (e.g. ties) or a mapping with 'name' and its parameters.")
    if m["name"] not in METHODS:
        raise UserError(f"{where}: unknown merge method {m['name']!r}; choose one of: {', '.join(METHODS)}.")
    params = METHODS[m["name"]].params
    extra = sorted(set(m) - {"name", *params})
    if extra:
        takes = ", ".join(params) if params else "no parameters (its plan says everything)"
        raise UserError(f"{where}: {m['name']} does not use {', '.join(extra)}; it takes {takes}.")
    kw = {"name": m["name"], **_read_all({k: v for k, v in m.items() if k != "name"}, where, "method")}
    mc = MethodConfig.from_dict(kw)
    mc.validate()
    return mc


def refuse_unknown(d: dict, allowed, where: str, has: str, kind: str = "key") -> None:
    """UserError naming the keys of `d` outside `allowed`, and what the mapping has (`has`)."""
    extra = sorted(set(d) - set(allowed))
    if extra:
        raise UserError(f"{where}: unknown {kind}{'s' if len(extra) > 1 else ''} {', '.join(extra)}; {has}.")


def _plan_from(p: Any, where: str) -> Plan:
    if not isinstance(p, dict):
        raise UserError(f"{where}: plan is a mapping of {', '.join(PLAN_FILE_KEYS)}.")
    refuse_unknown(p, PLAN_FILE_KEYS, where, f"a plan has {', '.join(PLAN_FILE_KEYS)}", kind="plan key")
    try:
        return Plan(**_read_all(p, where, "plan"))
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: cannot read the plan ({e}).") from None


_FILE_FIELDS = {part: {getattr(f, part): f for f in FIELDS if getattr(f, part)} for part in ("plan", "method")}


def _read_all(d: dict, where: str, part: str) -> dict:
    """The given (not None, not empty) values of a file's plan or method mapping, each read by its field."""
    return {k: r for k, v in d.items() if (r := _read(k, v, where, part)) is not None}


def _read(key: str, value: Any, where: str, part: str) -> Any:
    """A recipe file's plan key or method parameter, read by its field (whole numbers must be written as such)."""
    f = _FILE_FIELDS[part][key]
    if f.kind == "int" and (not isinstance(value, int) or isinstance(value, bool)):
        raise UserError(f"{where}: {part} {key} is a whole number (got {value!r:.40}).")
    try:
        return f.read(value)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
