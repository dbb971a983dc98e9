"""The weight-diff prior: b, u, tb, tu from the layers where the language expert's change dominates (a prior for
the plan search, `layerswap.search`, not an answer)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from layerswap.core.errors import UserError
from layerswap.recipe.plans import Plan
from layerswap.core.roles import EXPERTS
from layerswap.analysis.records import METRICS

SUGGEST_RULE = (
    "per layer, each expert's change is divided by that expert's mean over all layers, so both are on their own "
    "scale; a layer is language-dominated when the language expert's normalised change is larger. b = the run of "
    "language-dominated layers from the bottom, u = the run from the top; one flat transition layer follows each "
    "swapped block when there is room, and at least one layer stays with the math expert."
)


@dataclass
class PlanSuggestion:
    """A layer-swap plan proposed from where the language expert's change dominates."""

    plan: Plan
    metric: str
    math_profile: list[float]  # per layer, normalised by the expert's own mean over layers
    lang_profile: list[float]
    lang_dominant: list[bool]
    rule: str
    note: str = ""

    def markdown(self) -> str:
        marks = "".join("L" if d else "·" for d in self.lang_dominant)
        out = (f"**The weight-diff prior: b={self.plan.b}, u={self.plan.u}, tb={self.plan.tb}, tu={self.plan.tu}** "
               f"(from {METRICS[self.metric]})  \nlanguage-dominated layers (bottom → top): `{marks}`  \n"
               f"*Rule:* {self.rule}  \n*A prior read off the weights, not an answer: **Find a plan** (Build tab, "
               "`layerswap search`) tests plans on questions.*")
        return out + (f"  \n*Note:* {self.note}" if self.note else "")


def suggest_plan(an, metric: str = "relative", k: float | None = None) -> PlanSuggestion:
    """Propose b, u (and tb, tu) from an `Analysis`'s per-layer profiles; see SUGGEST_RULE."""
    if metric not in ("relative", "mean_abs", "topk"):
        raise UserError(f"suggest_plan compares relative, mean_abs or topk, not {metric!r}.")
    L = an.num_layers
    prof = {}
    for role in EXPERTS:
        p = np.nan_to_num(an.layer_profile(role, metric, k), nan=0.0)
        m = float(p.mean())
        prof[role] = p / m if m > 0 else p
    dom = [bool(prof["lang"][i] > prof["math"][i]) for i in range(L)]
    b = next((i for i, d in enumerate(dom) if not d), L)
    u = next((i for i, d in enumerate(reversed(dom)) if not d), L)
    note = ""
    if b == L:
        b, u = L - 1, 0
        note = "the language expert dominates every layer; one layer is left to the math expert."
    elif b + u > L - 1:
        u = max(L - 1 - b, 0)
    if not any(dom):
        note = "the math expert dominates every layer: nothing to swap by this rule."
    tb = 1 if b > 0 else 0
    tu = 1 if u > 0 else 0
    while b + tb + tu + u > L - 1 and (tb or tu):
        if tu:
            tu = 0
        else:
            tb = 0
    plan = Plan(b=b, u=u, tb=tb, tu=tu)
    return PlanSuggestion(plan, metric, [float(x) for x in prof["math"]], [float(x) for x in prof["lang"]],
                          dom, SUGGEST_RULE, note)
