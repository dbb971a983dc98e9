"""Where a search starts: plans read off the experts' weight changes, tried first.

Two rules, both priors (what the weights suggest), never answers (what the evaluation says):

- **the weight-diff prior** (`analysis.suggest`): each expert's change per layer on its own scale; b and u are
  the runs of layers where the language expert's normalised change is larger, with a transition layer each;
- **the τ rule** (after Shin & Hwang, EACL 2026): a layer (or, module-wise, its attention or MLP block) comes
  from the language expert when the language expert's relative change ‖Δ‖/‖θ_base‖ is more than τ times the
  math expert's; b and u are the runs of such layers from the bottom and the top. τ in `TAUS`.

Both need the analysis against the base; without a base the search starts from the default plan only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from layerswap.recipe.plans import Plan, default_plan
from layerswap.search.space import Space, canonical

TAUS = (0.5, 1.0, 2.0)


@dataclass(frozen=True)
class Prior:
    name: str
    plan: Plan


def _runs(lang: list[bool]) -> tuple[int, int]:
    """Runs of True from the bottom and from the top (together leaving at least one layer)."""
    L = len(lang)
    b = next((i for i, x in enumerate(lang) if not x), L)
    u = next((i for i, x in enumerate(reversed(lang)) if not x), L)
    if b == L:
        return L - 1, 0
    return b, min(u, L - 1 - b)


def tau_rule(an, tau: float, group: str | None = None) -> Plan:
    """The τ rule's plan: layers (or their `group`, attention or mlp) whose language change exceeds τ × the math
    expert's, as bottom and top runs."""
    L = an.num_layers
    groups: list[list[int]] = [[] for _ in range(L)]
    for i, t in enumerate(an.tensors):
        if t.layer is not None and (group is None or an.arch.group(t.ptype) == group):
            groups[t.layer].append(i)
    rel = {r: np.nan_to_num(an.aggregate(r, "relative", groups), nan=0.0) for r in ("math", "lang")}
    lang = [bool(rel["lang"][i] > tau * rel["math"][i]) for i in range(L)]
    b, u = _runs(lang)
    return Plan(b=b, u=u, tb=0, tu=0, modules=group or "all")


def priors(space: Space, an=None, opening=None) -> list[Prior]:
    """The plans a search tries first, in order, each once and only if the space holds it: the weight-diff prior
    and the τ rule's plans (with an analysis), then the models' own plan (`opening`: an `organisms.Opening`, a
    shipped pair's recommended plan; default: the literature's plan scaled, `plans.default_plan`)."""
    out: list[Prior] = []
    if an is not None:
        out.append(Prior("the weight-diff prior", an.suggest_plan("relative").plan))
        for tau in TAUS:
            out.append(Prior(f"τ rule (τ = {tau:g})", tau_rule(an, tau)))
            if space.module_wise:
                out += [Prior(f"τ rule (τ = {tau:g}, {g} only)", tau_rule(an, tau, g)) for g in ("attention", "mlp")]
    if opening is not None and "recommended" in opening.why:
        out.append(Prior("the recommended plan", opening.plan))
    else:
        out.append(Prior("the default plan", opening.plan if opening is not None else default_plan(space.num_layers)))
    seen, kept = set(), []
    for p in out:
        plan = canonical(p.plan)
        if space.params(plan) is None:
            continue
        e = space.effect(plan)
        if e not in seen:
            seen.add(e)
            kept.append(Prior(p.name, plan))
    return kept
