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
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Sequence

from .errors import UserError
from .methods import METHODS, MethodConfig
from .plans import Plan, default_plan, format_layers, parse_layers

PLAN_KEYS = tuple(f.name for f in fields(Plan))


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
    def from_values(cls, *, num_layers: int | None = None, method: str | None = None, b=None, u=None, tb=None,
                    tu=None, transition=None, transition_weight=None, non_layer=None, kind=None, layer_weights=None,
                    k=None, seed=None, offset=None, modules=None, revert=None, weight=None, expert_weights=None,
                    lam=None, density=None, drop_rate=None) -> "Recipe":
        """A recipe from loose values as the CLI and the app hold them (strings, floats from sliders, None
        for "not given"). Missing b/u/tb/tu take `default_plan(num_layers)` (the literature's setting,
        scaled); `layer_weights` and `expert_weights` may be comma-separated strings. Parameters of the
        other part (plan values for a soup) are ignored, as the app keeps every control."""
        name = method or "layer_swap"
        if name not in METHODS:
            raise UserError(f"Unknown merge method {name!r}; choose one of: {', '.join(METHODS)}.")
        mc = MethodConfig(
            name=name, weight=_num(weight, 0.5, "weight"), lam=_num(lam, 1.0, "lambda"),
            expert_weights=_floats(expert_weights, "expert weights") if expert_weights not in (None, "") else (1.0, 1.0),
            density=_num(density, 0.2, "density"), drop_rate=_num(drop_rate, 0.9, "drop rate"),
            seed=int(_num(seed, 0, "seed")))
        if len(mc.expert_weights) != 2:
            raise UserError("expert weights take two numbers: math, language (e.g. 1,1).")
        mc.validate()
        if not mc.spec.uses_plan:
            return cls(mc)
        d = default_plan(num_layers) if num_layers else Plan()
        counts = {"b": b, "u": u, "tb": tb, "tu": tu}
        given = {key: v for key, v in counts.items() if v is not None}
        counts = {key: int(given.get(key, getattr(d, key))) for key in counts}
        kind = kind or ("weights" if layer_weights not in (None, "") else "swap")  # weights alone imply the kind
        weights = _floats(layer_weights, "layer weights") if kind == "weights" and layer_weights not in (None, "") else None
        plan = Plan(**counts, transition=transition or "flat",
                    transition_weight=_num(transition_weight, 0.5, "transition weight"),
                    non_layer=non_layer or "neighbour", kind=kind, weights=weights if kind == "weights" else None,
                    k=int(_num(k, 0, "k")), seed=int(_num(seed, 0, "seed")), offset=int(_num(offset, 0, "offset")),
                    modules=modules or "all", revert=parse_layers(revert) if revert not in (None, "") else ())
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
    kw = dict(m)
    for key in params:
        if key == "expert_weights" and key in kw:
            kw[key] = _floats(kw[key], f"{where}: expert_weights")
        elif key == "seed" and key in kw:
            kw[key] = int(_num(kw[key], 0, f"{where}: seed"))
        elif key in kw:
            kw[key] = _num(kw[key], 0.0, f"{where}: {key}")
    mc = MethodConfig.from_dict(kw)
    if len(mc.expert_weights) != 2:
        raise UserError(f"{where}: expert_weights takes two numbers: math, language.")
    mc.validate()
    return mc


def refuse_unknown(d: dict, allowed, where: str, has: str, kind: str = "key") -> None:
    """UserError naming the keys of `d` outside `allowed`, and what the mapping has (`has`)."""
    extra = sorted(set(d) - set(allowed))
    if extra:
        raise UserError(f"{where}: unknown {kind}{'s' if len(extra) > 1 else ''} {', '.join(extra)}; {has}.")


def _plan_from(p: Any, where: str) -> Plan:
    if not isinstance(p, dict):
        raise UserError(f"{where}: plan is a mapping of {', '.join(PLAN_KEYS)}.")
    refuse_unknown(p, PLAN_KEYS, where, f"a plan has {', '.join(PLAN_KEYS)}", kind="plan key")
    for key in ("b", "u", "tb", "tu", "k", "seed", "offset"):
        if key in p and (not isinstance(p[key], int) or isinstance(p[key], bool)):
            raise UserError(f"{where}: plan {key} is a whole number (got {p[key]!r}).")
    try:
        return Plan.from_dict(p)
    except (TypeError, ValueError) as e:
        raise UserError(f"{where}: cannot read the plan ({e}).") from None


def _num(v: Any, default: float, what: str) -> float:
    if v is None or v == "":
        return default
    if isinstance(v, bool):
        raise UserError(f"{what} is a number (got {v!r}).")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise UserError(f"{what} is a number (got {v!r}).") from None


def _floats(v: Any, what: str) -> tuple[float, ...]:
    if isinstance(v, str):
        v = [x for x in v.replace(" ", "").split(",") if x]
    if not isinstance(v, Sequence):
        raise UserError(f"{what}: comma-separated numbers, e.g. 1,1 (got {v!r}).")
    return tuple(_num(x, 0.0, what) for x in v)
