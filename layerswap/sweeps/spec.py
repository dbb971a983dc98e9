"""Sweep files: experts, recipes (a list or a grid), test sets, evaluation settings and statistics, in YAML/JSON.

    name: transition zone
    experts: {math: ../demo/math, lang: ../demo/lang, base: ../demo/base}   # or expert_sets: [{name, ...}]
    # or a family: one math expert, a language expert per MGSM code, each scored on its own language only
    # family: {math: ../demo3/math, base: ../demo3/base, langs: {qa: ../demo3/lang_qa, qb: ../demo3/lang_qb}}
    recipes:                                                # a list of named recipes (layerswap.recipe.recipes)
      - {name: none, plan: {b: 2, u: 1, tb: 0, tu: 0}}
      - {name: soup, method: {name: soup, weight: 0.5}}
      - {name: own, plan: {b: 2, u: 1, tb: 0, tu: 0}, langs: {qb: {b: 3, u: 1}}}   # a family member's own plan
    grid:                                                   # and/or grids (one mapping or a list of them)
      name: "b={b} u={u}"
      recipe: {plan: {tb: 0, tu: 0}}                        # the fixed part
      vary: {b: [0, 1, 2, 3], u: [0, 1, 2]}                 # plan keys, method parameters, or t (tb = tu)
    test_sets: [{path: ../demo/mgsm, langs: [xx, en]}]      # or paths, with langs: [...] at the top
    eval: {limit: 20, shots: 0, mode: native_cot, max_new_tokens: 128}
    engine: {engine: transformers, device: cpu, batch_size: 64}
    include_experts: true                                   # the experts themselves as reference rows
    stats: true                                             # each expert's distance from the base
    build: python scripts/build_demo_experts.py --ablation-experts   # said when experts are missing

A ``family:`` becomes one expert set per language, named by its code (the math expert with that language's expert),
each evaluated on its own language's questions only; its test sets' ``langs`` default to the family's codes, and the
report shows the paper's table (a row per model, a column per language, `report.family_table`). A listed recipe's
``langs: {CODE: {b: .., u: ..}}`` gives a family member its own plan keys, the rest of the recipe kept (as the page's
per-language plans do): that member runs it under the recipe's name (`SweepSpec.points_for`).
Relative paths are read from the sweep file's folder; ``assets:`` references name shipped models and sets
wherever the file is. Grid points that do not fit the experts'
layer count are left out (and counted); listed recipes that do not fit are refused.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from layerswap.engines import EngineSettings
from layerswap.core.errors import UserError
from layerswap.evaluation.run import EvalConfig
from layerswap.recipe.fields import PLAN_FILE_KEYS
from layerswap.models.family import MAX_LANGS, Family, Member, check_code
from layerswap.models.hub import looks_like_hub_id
from layerswap.recipe.methods import METHODS
from layerswap.models.presets import ASSETS_PREFIX, assets_dir, portable_ref
from layerswap.recipe.recipes import Recipe, read_data_file, refuse_unknown

TOP_KEYS = ("name", "experts", "expert_sets", "family", "recipes", "grid", "test_sets", "langs", "eval", "engine",
            "include_experts", "stats", "build")
EVAL_KEYS = ("limit", "shots", "mode", "max_new_tokens")
ENGINE_KEYS = tuple(f.name for f in fields(EngineSettings))
FAMILY_KEYS = ("name", "math", "base", "langs", "force")


@dataclass(frozen=True)
class TestSet:
    """An MGSM-format folder (None: $LAYERSWAP_MGSM_DIR, else the Hub) and the languages scored on it."""

    name: str
    path: str | None
    langs: tuple[str, ...]

    def config(self, settings: dict) -> EvalConfig:
        return EvalConfig(langs=list(self.langs), source=self.path, **settings)


@dataclass(frozen=True)
class ExpertSet:
    """Two experts (and their base) merged by every recipe; `force` merges a pair that seems not to share the base."""

    name: str
    math: str
    lang: str
    base: str | None = None
    force: bool = False
    langs: tuple[str, ...] = ()  # a family member's own language: scored on it only (empty: every test set's)
    family: str | None = None  # the family it is a member of (the sweep file's ``family:``)

    def refs(self) -> dict[str, str]:
        return {r: getattr(self, r) for r in ("math", "lang", "base") if getattr(self, r)}

    def scored_on(self, tests: list[TestSet]) -> list[TestSet]:
        """The test sets this set is evaluated on, each holding only the languages it is scored on."""
        if not self.langs:
            return list(tests)
        kept = [replace(t, langs=tuple(x for x in t.langs if x in self.langs)) for t in tests]
        return [t for t in kept if t.langs]


@dataclass(frozen=True)
class SweepPoint:
    """One recipe of a sweep, with its name and (for grid points) the grid coordinates."""

    name: str
    recipe: Recipe
    vars: tuple[tuple[str, Any], ...] = ()
    from_grid: bool = False
    langs: tuple[tuple[str, Recipe], ...] = ()  # a family member's own recipe, by code (the recipe's ``langs:``)

    def to_dict(self) -> dict:
        return {"name": self.name, **self.recipe.to_dict()}


@dataclass
class SweepSpec:
    name: str
    expert_sets: list[ExpertSet]
    points: list[SweepPoint]
    test_sets: list[TestSet]
    eval: dict = field(default_factory=dict)  # EvalConfig settings besides langs and source
    engine: dict = field(default_factory=dict)  # EngineSettings, as the file gives them
    include_experts: bool = True
    stats: bool = False
    build: str | None = None
    path: Path | None = None

    def missing(self) -> list[str]:
        """Expert folders that do not exist (Hub ids are not checked here)."""
        out = []
        for s in self.expert_sets:
            for ref in s.refs().values():
                shipped = ref.startswith(ASSETS_PREFIX) and (assets_dir() / ref[len(ASSETS_PREFIX):]).is_dir()
                if not shipped and not Path(ref).exists() and not looks_like_hub_id(ref):
                    out.append(ref)
        return out

    def check_experts(self) -> None:
        miss = self.missing()
        if miss:
            where = f"{self.path}: " if self.path else ""
            build = (f" Build them with: {self.build}" if self.build else
                     " Point the sweep file at existing model folders or Hub ids.")
            raise UserError(f"{where}{len(miss)} expert folder{'s are' if len(miss) > 1 else ' is'} missing: "
                            f"{', '.join(miss)}.{build}")

    def eval_settings(self) -> dict:
        return {k: self.eval[k] for k in EVAL_KEYS if k in self.eval}

    def points_for(self, s: ExpertSet) -> list[SweepPoint]:
        """The points as expert set `s` runs them: a family member's own recipe (a listed recipe's ``langs:``) in
        place of the shared one, under the same name."""
        code = s.langs[0] if s.family and len(s.langs) == 1 else None
        out = []
        for p in self.points:
            own = dict(p.langs).get(code)
            out.append(replace(p, recipe=own, langs=()) if own is not None else p)
        return out

    def evaluations(self) -> int:
        """The evaluations this sweep asks for, counted before any model opens (points a model's layers cannot
        take are dropped later, so this bounds `records.units_of`): per expert set, each test set it is scored
        on times its recipes, plus its two experts when `include_experts`. A family of N counts N times."""
        models = len(self.points) + (2 if self.include_experts else 0)
        return sum(models * len(s.scored_on(self.test_sets)) for s in self.expert_sets)


def load_spec(path: str | os.PathLike) -> SweepSpec:
    """Read and check a sweep file (YAML or JSON)."""
    path = Path(path).expanduser()
    return spec_from_dict(read_data_file(path), folder=path.resolve().parent, path=path)


def spec_from_dict(d: Any, folder: Path | None = None, path: Path | None = None) -> SweepSpec:
    where = str(path) if path else "sweep"
    if not isinstance(d, dict):
        raise UserError(f"{where}: a sweep file is a mapping with experts, recipes or grid, and test_sets.")
    refuse_unknown(d, TOP_KEYS, where, f"a sweep file has {', '.join(TOP_KEYS)}")
    folder = folder or Path.cwd()
    sets = _expert_sets(d, folder, where)
    points = _points(d, where)
    codes = tuple(x for s in sets for x in s.langs)
    members = [c for s in sets if s.family for c in s.langs]
    for p in points:
        for c, _ in p.langs:
            if c not in members:
                raise UserError(f"{where}: recipe {p.name!r} gives {c} its own plan, but {c} is not a language of the "
                                f"sweep's family ({', '.join(members) or 'it has none'}).")
    tests = _test_sets(d, folder, where, codes)
    for c in codes:
        if not any(c in t.langs for t in tests):
            raise UserError(f"{where}: the family's {c} expert is scored on {c} questions, but no test set lists "
                            f"{c}: add it to the test set's langs (or leave langs out: a family's default is its "
                            "codes).")
    ev = _mapping(d.get("eval", {}), EVAL_KEYS, f"{where}: eval")
    eng = _mapping(d.get("engine", {}), ENGINE_KEYS, f"{where}: engine")
    for t in tests:
        t.config(ev).validate()
    return SweepSpec(name=str(d.get("name") or (path.stem if path else "sweep")), expert_sets=sets, points=points,
                     test_sets=tests, eval=ev, engine=eng, include_experts=bool(d.get("include_experts", True)),
                     stats=bool(d.get("stats", False)), build=d.get("build"), path=path)


def fit_points(points: list[SweepPoint], num_layers: int, where: str = "sweep") -> tuple[list[SweepPoint], int]:
    """The points whose recipe fits `num_layers` layers, and how many grid points were left out; a listed
    recipe that does not fit is refused."""
    keep, dropped = [], 0
    for p in points:
        try:
            p.recipe.validate(num_layers)
            keep.append(p)
        except UserError as e:
            if not p.from_grid:
                raise UserError(f"{where}: recipe {p.name!r}: {e}") from None
            dropped += 1
    return keep, dropped


# ---- parts ------------------------------------------------------------------------------------------

def _path(ref: Any, folder: Path, what: str) -> str:
    if not isinstance(ref, str) or not ref:
        raise UserError(f"{what} is a folder or a Hub id (got {ref!r}).")
    if ref.startswith(ASSETS_PREFIX):  # a shipped model or MGSM set, wherever the file is
        return ref
    p = Path(ref).expanduser()
    p = p if p.is_absolute() else folder / p
    if p.exists() or ref.startswith((".", "/", "~")) or not looks_like_hub_id(ref):
        return str(p.resolve())
    return ref


def set_name(math: str, lang: str) -> str:
    """How a sweep names an expert set the file leaves unnamed: by its two experts, as results files name models
    (`presets.portable_ref`), e.g. ``assets:demo/{math, lang}``."""
    m, lg = portable_ref(math), portable_ref(lang)
    (mp, _, mn), (lp, _, ln) = m.rpartition("/"), lg.rpartition("/")
    return f"{mp}/{{{mn}, {ln}}}" if mp and mp == lp else f"{m} + {lg}"


def _expert_sets(d: dict, folder: Path, where: str) -> list[ExpertSet]:
    if sum(k in d for k in ("experts", "expert_sets", "family")) != 1:
        raise UserError(f"{where}: give the experts once, as experts: {{math, lang, base}}, as expert_sets: [...] "
                        "or as family: {math, base, langs: {CODE: language expert}}.")
    if "family" in d:
        return _family(d["family"], folder, where)
    raw = [d["experts"]] if "experts" in d else d["expert_sets"]
    if not isinstance(raw, list) or not raw:
        raise UserError(f"{where}: expert_sets is a list of {{name, math, lang, base, force}}.")
    out, names = [], set()
    for i, s in enumerate(raw):
        what = f"{where}: expert set {i + 1}"
        if not isinstance(s, dict):
            raise UserError(f"{what} is a mapping of math, lang, base, name, force.")
        extra = sorted(set(s) - {"name", "math", "lang", "base", "force"})
        if extra or "math" not in s or "lang" not in s:
            raise UserError(f"{what}: needs math and lang (and may have base, name, force); got {', '.join(sorted(s))}.")
        math, lang = _path(s["math"], folder, f"{what} math"), _path(s["lang"], folder, f"{what} lang")
        name = str(s.get("name") or set_name(math, lang))
        name = name if s.get("name") or name not in names else f"set {i + 1}"
        if name in names:
            raise UserError(f"{where}: two expert sets are named {name!r}.")
        names.add(name)
        out.append(ExpertSet(name, math, lang, _path(s["base"], folder, f"{what} base") if s.get("base") else None,
                             bool(s.get("force", False))))
    return out


def _family(f: Any, folder: Path, where: str) -> list[ExpertSet]:
    """A ``family:`` as one expert set per language (named by its code, scored on that language only), checked as
    `models.family.Family` checks the CLI's ``--lang CODE=REF`` (codes, each once, at most MAX_LANGS)."""
    shape = "a family is {math: M, base: B, langs: {CODE: L, ...}, force, name}"
    if not isinstance(f, dict):
        raise UserError(f"{where}: {shape}.")
    refuse_unknown(f, FAMILY_KEYS, f"{where}: family", shape)
    langs = f.get("langs")
    if not isinstance(langs, dict) or not langs or "math" not in f:
        raise UserError(f"{where}: {shape}, with its math expert and at least one language.")
    if len(langs) > MAX_LANGS:
        raise UserError(f"{where}: the family has {len(langs)} language experts; at most {MAX_LANGS}.")
    members = tuple(Member(check_code(str(c)), _path(r, folder, f"{where}: family {c}")) for c, r in langs.items())
    family = Family(_path(f["math"], folder, f"{where}: family math"), members,
                    _path(f["base"], folder, f"{where}: family base") if f.get("base") else None)
    family.validate()
    name, force = str(f.get("name") or "family"), bool(f.get("force", False))
    return [ExpertSet(m.code, family.math, m.ref, family.base, force, (m.code,), name) for m in members]


def _points(d: dict, where: str) -> list[SweepPoint]:
    points: list[SweepPoint] = []
    for i, r in enumerate(d.get("recipes") or []):
        if not isinstance(r, dict):
            raise UserError(f"{where}: recipe {i + 1} is a mapping with name, method and/or plan.")
        body = {k: v for k, v in r.items() if k not in ("name", "langs")}
        rec = Recipe.from_dict(body, where=f"{where}: recipe {r.get('name', i + 1)!r}")
        name = str(r.get("name") or rec.title())
        points.append(SweepPoint(name, rec, langs=_own_recipes(r.get("langs"), body, rec, f"{where}: recipe {name!r}")))
    grids = d.get("grid") or []
    for g in grids if isinstance(grids, list) else [grids]:
        points += _grid(g, where)
    if not points:
        raise UserError(f"{where}: no recipes; give recipes: [...] and/or grid: {{vary: ...}}.")
    names = [p.name for p in points]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"{where}: recipe names must differ; repeated: {', '.join(dup)}.")
    return points


def _own_recipes(langs: Any, body: dict, rec: Recipe, where: str) -> tuple[tuple[str, Recipe], ...]:
    """A listed recipe's ``langs: {CODE: {plan keys}}``: each code's recipe, the body with those plan keys."""
    if langs is None:
        return ()
    shape = "langs is {CODE: {b: .., u: .., tb: .., tu: ..}}: a family member's own plan keys"
    if not isinstance(langs, dict) or not langs or len(langs) > MAX_LANGS:
        raise UserError(f"{where}: {shape}, at most {MAX_LANGS} codes.")
    if rec.plan is None:
        raise UserError(f"{where}: a {rec.method.name} merge has no plan to give a language; per-language plans are "
                        "for layer swaps.")
    out = []
    for c, keys in langs.items():
        if not isinstance(keys, dict) or not keys:
            raise UserError(f"{where}: {shape}.")
        refuse_unknown(keys, PLAN_FILE_KEYS, f"{where}: langs {c}", shape)
        plan = {**(body.get("plan") or {}), **keys}
        out.append((check_code(str(c)), Recipe.from_dict({**body, "plan": plan}, where=f"{where}: langs {c}")))
    return tuple(out)


def _grid(g: Any, where: str) -> list[SweepPoint]:
    if not isinstance(g, dict) or not isinstance(g.get("vary"), dict) or not g["vary"]:
        raise UserError(f"{where}: a grid is {{vary: {{b: [0, 1], u: [0, 1]}}, recipe: {{...}}, name: 'b={{b}} u={{u}}'}}.")
    extra = sorted(set(g) - {"vary", "recipe", "name"})
    if extra:
        raise UserError(f"{where}: unknown grid key {', '.join(extra)}; a grid has vary, recipe and name.")
    fixed = g.get("recipe") or {}
    if not isinstance(fixed, dict):
        raise UserError(f"{where}: grid recipe is a mapping with method and/or plan.")
    vary = g["vary"]
    method = fixed.get("method", "layer_swap")
    mname = method if isinstance(method, str) else (method or {}).get("name", "layer_swap")
    if mname not in METHODS:
        raise UserError(f"{where}: unknown merge method {mname!r}; choose one of: {', '.join(METHODS)}.")
    params, uses_plan = METHODS[mname].params, METHODS[mname].uses_plan
    for k, vals in vary.items():
        if k not in ((*PLAN_FILE_KEYS, "t") if uses_plan else ()) + params:
            raise UserError(f"{where}: grid cannot vary {k!r}; it varies plan keys ({', '.join(PLAN_FILE_KEYS)}), t "
                            f"(tb = tu) or the method's parameters ({', '.join(params) or 'none'}).")
        if not isinstance(vals, list) or not vals:
            raise UserError(f"{where}: grid values of {k} are a non-empty list.")
    template = str(g.get("name") or " ".join(f"{k}={{{k}}}" for k in vary))
    out = []
    for combo in itertools.product(*vary.values()):
        values = dict(zip(vary, combo))
        plan = dict(fixed.get("plan") or {}) if uses_plan else None
        meth = dict(method) if isinstance(method, dict) else {"name": method}
        for k, v in values.items():
            if k == "t":
                plan.update(tb=v, tu=v)
            elif k in PLAN_FILE_KEYS:
                plan[k] = v
            else:
                meth[k] = v
        body = {"method": meth, **({"plan": plan} if plan is not None else {})}
        try:
            name = template.format(**values)
        except (KeyError, IndexError):
            raise UserError(f"{where}: grid name {template!r} names something that does not vary.") from None
        rec = Recipe.from_dict(body, where=f"{where}: grid point {name!r}")
        out.append(SweepPoint(name, rec, tuple(values.items()), from_grid=True))
    return out


def _test_sets(d: dict, folder: Path, where: str, family: tuple[str, ...] = ()) -> list[TestSet]:
    langs = d.get("langs") or (list(family) if family else None)
    raw = d.get("test_sets")
    if not raw:
        raise UserError(f"{where}: give test_sets: [{{path: MGSM_FOLDER, langs: [sw, te]}}] (path null: "
                        "$LAYERSWAP_MGSM_DIR or the Hub).")
    out = []
    for i, t in enumerate(raw if isinstance(raw, list) else [raw]):
        t = {"path": t} if isinstance(t, str) or t is None else t
        if not isinstance(t, dict) or set(t) - {"path", "langs", "name"}:
            raise UserError(f"{where}: test set {i + 1} is a path or {{path, langs, name}}.")
        ls = t.get("langs", langs)
        if not ls or not isinstance(ls, list):
            raise UserError(f"{where}: test set {i + 1} needs langs: [...] (or langs at the top of the file).")
        path = _path(t["path"], folder, f"{where}: test set {i + 1}") if t.get("path") else None
        name = str(t.get("name") or (Path(path).name if path else "mgsm"))
        out.append(TestSet(name, path, tuple(str(x) for x in ls)))
    return out


def _mapping(m: Any, keys: tuple[str, ...], what: str) -> dict:
    if not isinstance(m, dict):
        raise UserError(f"{what} is a mapping of {', '.join(keys)}.")
    refuse_unknown(m, keys, what, f"it has {', '.join(keys)}")
    return dict(m)


def with_eval(spec: SweepSpec, **changes) -> SweepSpec:
    """The same sweep with some evaluation settings changed (e.g. a smaller limit)."""
    return replace(spec, eval={**spec.eval, **{k: v for k, v in changes.items() if v is not None}})

