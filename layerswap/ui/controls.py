"""The plan controls: their values as a recipe, as a shareable query string, and back.

The page sends the same plan values with every event, in the order of the recipe-field table's share-link
keys (`layerswap.recipe.fields.LINK_KEYS`), so each visitor's events use that visitor's plan. `plan_inputs` puts
the page's controls in that order. `read_plan` reads them once per event (`Context.job(plan=True)`) into
`PlanControls`: the one `Recipe` every handler and library call of the event is given, and its `Sources` for the
visitor's model, made once. `query_string` writes the values (with the models and tab) for a link; `restore`
reads such a link back into control updates, each value read and bounded by its field. A family's per-language
plans are ``CODE=b,u,tb,tu`` lines (`plan_lines`, `own_plans`): one language's variant of the page's plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlencode

import gradio as gr

from layerswap.core.errors import UserError
from layerswap.core.markup import text
from layerswap.models.family import MAX_LANGS, MAX_SPEC_CHARS, Family, check_code, split_spec
from layerswap.recipe.fields import FIELDS, LINK_KEYS
from layerswap.recipe.plans import Plan, format_layers
from layerswap.analysis.plots import layer_strip
from layerswap.recipe.recipes import Recipe
from layerswap.recipe.sources import Sources

TABS = ("build", "analysis", "evaluate", "sweeps")
_BY_KEY = {f.key: f for f in FIELDS}


def plan_inputs(**by_key) -> list:
    """The page's plan controls in `LINK_KEYS` order, given by share-link key (every key exactly once)."""
    if set(by_key) != set(LINK_KEYS):
        raise ValueError(f"plan controls missing {sorted(set(LINK_KEYS) - set(by_key))}, "
                         f"unknown {sorted(set(by_key) - set(LINK_KEYS))}")
    return [by_key[k] for k in LINK_KEYS]


def recipe(*values, **by_key) -> Recipe:
    """The recipe of the controls' values (in `LINK_KEYS` order, or by key; missing ones take their
    defaults), through `Recipe.from_values`, validated where it does not need the model."""
    given = {**dict(zip(LINK_KEYS, values)), **by_key}
    return Recipe.from_values(**{_BY_KEY[k].name: v for k, v in given.items()})


@dataclass(eq=False)
class PlanControls:
    """One event's plan controls, read once (`read_plan`): their `values` (`LINK_KEYS` order: what a share link
    writes back, every control kept) and the `Recipe` read from them, or the mistake that refused them (raised
    where the recipe is asked for, so a handler says it as it always did)."""

    values: tuple
    _recipe: Recipe | None = None
    _error: str = ""
    _sources: dict = field(default_factory=dict, repr=False)

    @property
    def recipe(self) -> Recipe:
        """The recipe of the controls (the same object all through the event); UserError when they were refused."""
        if self._recipe is None:
            raise UserError(self._error)
        return self._recipe

    def variant(self, **by_key) -> Recipe:
        """The controls' values with some replaced (by share-link key), read as the event's recipe was: a family's
        baseline (``method=ties`` with the page's method values) or one language's own plan (``b=3``)."""
        self.recipe  # the controls themselves were accepted
        return recipe(*self.values, **by_key)

    def for_language(self, own: dict[str, dict[str, int]], code: str) -> Recipe:
        """Language `code`'s merge in a family: the page's plan with the language's own b, u, tb, tu (`own_plans`)
        when it has a line and the page's plan is a layer swap (the rest of the plan kept), else the page's."""
        if code in own and self.recipe.method.name == "layer_swap":
            return self.variant(**own[code])
        return self.recipe

    def sources(self, num_layers: int) -> Sources:
        """The planner of the recipe for a model of `num_layers` layers, made once per event: validated against
        the model (the check before a build), it draws the strip and writes the plan text."""
        if num_layers not in self._sources:
            self._sources[num_layers] = Sources(self.recipe, num_layers)
        return self._sources[num_layers]


def read_plan(values) -> PlanControls:
    """The controls' values (`LINK_KEYS` order) read into one recipe (`recipe`), or the mistake kept for the handler."""
    values = tuple(values)
    try:
        return PlanControls(values, recipe(*values))
    except UserError as e:
        return PlanControls(values, _error=str(e))


def strip_figure(src: Sources):
    """The layer-source strip of the planner's recipe (reverted layers marked)."""
    return layer_strip(src, src.num_layers)


def plan_md(src: Sources, built: bool, short: bool = False) -> str:
    """The plan in words: its title, whether the merged model holds it, and (unless `short`) where each layer is from."""
    r, num_layers = src.recipe, src.num_layers
    title = r.title() if r.plan is not None else f"{r.method.describe()} on every tensor"
    if short:
        return f"{title}, {num_layers} layers"
    state = "**Built: the merged model answers with this plan.**" if built else \
        "*Preview: built automatically when you ask, evaluate or analyse.*"
    if r.plan is None:
        return f"{state} {title} ({num_layers} layers). {r.method.spec.description}"
    lines = src.describe().replace("\n", "  \n")
    return f"{state} {title} ({num_layers} layers)  \n{lines}"


def plan_values(plan: Plan) -> list:
    """Control updates (in `LINK_KEYS` order) that set the page's plan controls to `plan` (layer swapping)."""
    params: dict = {"method": "layer_swap"}
    for f in FIELDS:
        if f.plan and f.plan != "weights":
            v = getattr(plan, f.plan)
            params[f.key] = format_layers(v) if f.plan == "revert" else v
    updates, _ = restore(params)
    if not plan.revert:  # restore leaves empty values alone: clear a revert left from an earlier plan
        i = [f.key for f in FIELDS].index(next(f.key for f in FIELDS if f.plan == "revert"))
        updates[i] = gr.update(value="")
    return updates


def query_string(refs: tuple[str, str, str], values, tab: str = "build", family: list[str] = (),
                 plans: str = "") -> str:
    """`?base=..&math=..&lang=..&b=..` for the page address: opening it restores this view (`family`: the
    visitor's family as ``CODE=REF`` lines, `plans` its per-language plans, `plan_specs`; `ui.family.restore`
    reads both back)."""
    q = dict(zip(("base", "math", "lang"), refs))
    q["family"] = "\n".join(family)
    q["family_plans"] = plans
    q.update(zip(LINK_KEYS, values))
    q["tab"] = tab
    return "?" + urlencode({k: v for k, v in q.items() if v not in (None, "")})


def restore(params: dict) -> tuple[list, str | None]:
    """Control updates (`LINK_KEYS` order) and the tab from a link's query parameters; values their field
    refuses (out of bounds, too long, not a choice) are ignored."""
    out = []
    for f in FIELDS:
        raw = params.get(f.key)
        try:
            value = f.read(raw)
        except UserError:
            value = None
        if value is None:
            out.append(gr.update())
        else:  # lists stay the text the control holds
            out.append(gr.update(value=str(raw) if f.kind in ("floats", "layers") else value))
    tab = params.get("tab")
    return out, tab if tab in TABS else None


# ---- a family's lines: CODE=REF (the experts, `ui.family`) and CODE=b,u,tb,tu (per-language plans) ----------------

MAX_TEXT = MAX_LANGS * (MAX_SPEC_CHARS + 2)  # a family's text area (and a link's value): a full family, no more
PLAN_KEYS = ("b", "u", "tb", "tu")


def lines_of(value: object, cap: int, what: str = "language experts") -> list[str]:
    """A text area's ``CODE=...`` lines (blank ones skipped), at most `cap`, bounded before anything reads them."""
    if value is None:
        return []
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise UserError(f"Give at most {MAX_TEXT:,} characters of {what}: one CODE=... line each.")
    lines = [line.strip() for line in value.splitlines() if line.strip()]
    if len(lines) > cap:
        raise UserError(f"{len(lines)} lines of {what}; at most {cap} are allowed here: drop "
                        f"{', '.join(text(x[:20]) for x in lines[cap:])}.")
    return lines


def plan_lines(value: object) -> dict[str, dict[str, int]]:
    """Per-language plans: ``CODE=b,u,tb,tu`` lines (each code once, at most MAX_LANGS), every number read and
    bounded by its field; code -> plan values (checked against a model where the plan is used)."""
    out: dict[str, dict[str, int]] = {}
    for line in lines_of(value, MAX_LANGS, "per-language plans"):
        code_, rest = split_spec(line)
        parts = rest.replace(",", " ").split()
        if code_ is None or len(parts) != len(PLAN_KEYS):
            raise UserError(f"Per-language plan {text(line[:40])}: write CODE=b,u,tb,tu, four whole numbers "
                            f"(e.g. sw=2,1,1,1).")
        check_code(code_)
        if code_ in out:
            raise UserError(f"Two per-language plans for {code_}; keep one line.")
        out[code_] = {k: _BY_KEY[k].read(x) for k, x in zip(PLAN_KEYS, parts)}
    return out


def own_plans(fam: Family, value: object) -> dict[str, dict[str, int]]:
    """`plan_lines` for family `fam`: each code one of its members'."""
    out = plan_lines(value)
    for code_ in out:
        if code_ not in fam.codes:
            raise UserError(f"Per-language plan for {code_}: write CODE=b,u,tb,tu with CODE one of the family's "
                            f"({', '.join(fam.codes)}).")
    return out


def plan_specs(value: object) -> str:
    """The per-language plans a share link carries: the lines normalised, or nothing when they are refused."""
    try:
        return "\n".join(f"{c}={','.join(str(p[k]) for k in PLAN_KEYS)}" for c, p in plan_lines(value).items())
    except UserError:
        return ""
