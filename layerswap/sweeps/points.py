"""Point lists for sweeps: the (b, u, t) grid of swap plans and the reviewers' ablation suite."""

from __future__ import annotations

from typing import Iterable

from layerswap.core.errors import UserError
from layerswap.recipe.methods import MethodConfig
from layerswap.recipe.plans import Plan, default_plan
from layerswap.recipe.recipes import Recipe
from layerswap.sweeps.spec import SweepPoint


def swap_grid(num_layers: int, b: Iterable[int], u: Iterable[int], t: Iterable[int] = (0, 1),
              transition: str = "flat", non_layer: str = "neighbour") -> list[SweepPoint]:
    """(b, u, tb = tu = t) swap plans that fit `num_layers`; (0, 0, 0) is the math expert itself."""
    points = []
    for bb in b:
        for uu in u:
            for tt in t:
                p = Plan(b=bb, u=uu, tb=tt, tu=tt, transition=transition, non_layer=non_layer)
                if bb + uu + 2 * tt <= num_layers and not (bb == uu == 0 and tt > 0):
                    points.append(SweepPoint(f"swap b={bb} u={uu} t={tt}", Recipe(plan=p),
                                             (("b", bb), ("u", uu), ("t", tt)), from_grid=True))
    if not points:
        raise UserError(f"No (b, u, t) in the grid fits the model's {num_layers} layers.")
    return points


def ablation_suite(num_layers: int, plan: Plan | None = None, seeds: Iterable[int] = (0, 1, 2),
                   with_base: bool = True) -> list[SweepPoint]:
    """The reviewers' ablations around `plan` (default: `default_plan`), plus the baselines."""
    p = plan or default_plan(num_layers)
    p.validate(num_layers)
    k = p.b + p.u  # swap as many layers elsewhere as the plan swaps at the ends
    pts = [
        SweepPoint(f"plan ({p.title()})", Recipe(plan=p)),
        SweepPoint("no transition zone", Recipe(plan=p.with_(tb=0, tu=0))),
        SweepPoint("transition: ramp", Recipe(plan=p.with_(transition="ramp"))),
        SweepPoint("transition: math only", Recipe(plan=p.with_(transition_weight=0.0))),
        SweepPoint("transition: language only", Recipe(plan=p.with_(transition_weight=1.0))),
        SweepPoint("bottom only", Recipe(plan=p.with_(u=0, tu=0))),
        SweepPoint("top only", Recipe(plan=p.with_(b=0, tb=0))),
        SweepPoint("attention only", Recipe(plan=p.with_(modules="attention"))),
        SweepPoint("MLP only", Recipe(plan=p.with_(modules="mlp"))),
        SweepPoint(f"middle {k} layers", Recipe(plan=Plan(kind="middle", k=k, non_layer="math"))),
        SweepPoint("inverse (language middle, math outer)",
                   Recipe(plan=Plan(kind="middle", k=num_layers - k, non_layer="math"))),
        SweepPoint("alternating", Recipe(plan=Plan(kind="alternating", non_layer="math"))),
    ]
    pts += [SweepPoint(f"random {k} layers, seed {s}", Recipe(plan=Plan(kind="random", k=k, seed=s, non_layer="math")))
            for s in seeds]
    pts.append(SweepPoint("soup 50/50", Recipe(MethodConfig("soup", weight=0.5))))
    if with_base:
        pts += [SweepPoint("task arithmetic", Recipe(MethodConfig("task_arithmetic"))),
                SweepPoint("TIES (density 0.2)", Recipe(MethodConfig("ties", density=0.2))),
                SweepPoint("DARE-TIES (drop 0.9)", Recipe(MethodConfig("dare_ties", drop_rate=0.9)))]
    return [pt for pt in pts if _fits(pt, num_layers)]


def _fits(pt: SweepPoint, num_layers: int) -> bool:
    try:
        pt.recipe.validate(num_layers)
        return True
    except UserError:
        return False
