"""The space of layer-swap plans a search explores, and the plans in it.

    space = Space(8)                        # b, u, tb, tu at any depth; transitions; non-layer choices
    space.size()                            # how many plans (counted, not listed)
    space.plan({"b": 2, "u": 0, "tb": 0, "tu": 0, ...})   # a Plan, or None when it does not fit the layers

Dimensions: `b, u, tb, tu` (each 0 .. its maximum, default the model's layer count; a plan whose
b + tb + tu + u exceeds the layers is invalid, and one that builds an expert unchanged is no merge: neither is
evaluated), the transition (``flat:W`` with its
language weight W, or ``ramp``), the non-layer choice, and optionally module-wise sources (the map on the
attention or the MLP of each layer only, the other part from the math expert) and a reverted range of
layers (their tensors from the base). Plans with the same effect (e.g. any transition when tb = tu = 0)
are written one way (`canonical`) and share one `effect` key, so no model is evaluated twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from layerswap.core.errors import UserError
from layerswap.recipe.plans import MODULES, NON_LAYER_OPTIONS, Plan

TRANSITIONS = ("flat:0.25", "flat:0.5", "flat:0.75", "ramp")


def read_transition(spec: str) -> tuple[str, float]:
    """``flat:0.5`` -> ("flat", 0.5); ``ramp`` -> ("ramp", 0.5)."""
    kind, _, w = str(spec).partition(":")
    try:
        weight = float(w) if w else 0.5
    except ValueError:
        weight = -1.0
    if kind not in ("flat", "ramp") or not 0.0 <= weight <= 1.0 or (kind == "ramp" and w):
        raise UserError(f"A transition is flat:W (W from 0 to 1, the language expert's weight) or ramp, not {spec!r}.")
    return kind, weight


def canonical(plan: Plan) -> Plan:
    """The one way of writing a swap plan among those with the same effect."""
    if plan.tb == plan.tu == 0 or plan.transition == "ramp":
        plan = plan.with_(transition="flat" if plan.tb == plan.tu == 0 else "ramp", transition_weight=0.5)
    return plan


@dataclass(frozen=True)
class Space:
    """The plans a search may try for a model of `num_layers` layers (see the module docstring)."""

    num_layers: int
    max_b: int | None = None
    max_u: int | None = None
    max_t: int | None = None  # tb and tu each
    transitions: tuple[str, ...] = TRANSITIONS
    non_layer: tuple[str, ...] = NON_LAYER_OPTIONS
    module_wise: bool = False
    revert: bool = False  # a reverted range (needs the base)

    def __post_init__(self) -> None:
        L = self.num_layers
        for name in ("max_b", "max_u", "max_t"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and 0 <= v):
                raise UserError(f"{name} is a whole number of layers >= 0 (got {v!r}).")
            object.__setattr__(self, name, L if v is None else min(v, L))
        if not self.transitions or not self.non_layer:
            raise UserError("The space needs at least one transition and one non-layer choice.")
        for t in self.transitions:
            read_transition(t)
        bad = [x for x in self.non_layer if x not in NON_LAYER_OPTIONS]
        if bad:
            raise UserError(f"Non-layer choices are {', '.join(NON_LAYER_OPTIONS)} (got {bad[0]!r}).")

    @property
    def modules(self) -> tuple[str, ...]:
        return MODULES if self.module_wise else ("all",)

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "max_b": self.max_b, "max_u": self.max_u, "max_t": self.max_t,
                "transitions": list(self.transitions), "non_layer": list(self.non_layer),
                "module_wise": self.module_wise, "revert": self.revert, "size": self.size()}

    # ---- one plan ---------------------------------------------------------------------------
    def plan(self, p: dict[str, Any]) -> Plan | None:
        """The canonical plan of these parameters, or None when it does not fit the model or builds an expert unchanged (never evaluated)."""
        b, u, tb, tu = (int(p[k]) for k in ("b", "u", "tb", "tu"))
        if b > self.max_b or u > self.max_u or tb > self.max_t or tu > self.max_t or b + u + tb + tu > self.num_layers:
            return None
        kind, weight = read_transition(p.get("transition", self.transitions[0]))
        start, length = int(p.get("revert_start", 0)), int(p.get("revert_len", 0))
        if start + length > self.num_layers:
            return None
        plan = Plan(b=b, u=u, tb=tb, tu=tu, transition=kind, transition_weight=weight,
                    non_layer=p.get("non_layer", self.non_layer[0]), modules=p.get("modules", "all"),
                    revert=tuple(range(start, start + length)))
        return None if self.unchanged_expert(plan) else canonical(plan)

    def unchanged_expert(self, plan: Plan) -> str | None:
        """``math`` or ``lang`` when `plan` builds that expert unchanged (every tensor from it: not a merge, and
        already a baseline of the report), else None. The search never chooses such a plan, as the organisms'
        cards never do."""
        lw, (embed, head), modules, revert = self.effect(plan)
        weights = {*lw, embed, head, plan.non_layer_weight("other", list(lw))}
        if revert or len(weights) != 1 or modules != "all":  # a module-wise swap keeps the other block's source
            return None
        return {0.0: "math", 1.0: "lang"}.get(weights.pop())

    def params(self, plan: Plan) -> dict[str, Any] | None:
        """The parameters of `plan` in this space (for seeding an optimiser), or None when it is not in it."""
        plan = canonical(plan)
        tr = "ramp" if plan.transition == "ramp" else f"flat:{plan.transition_weight:g}"
        if plan.tb == plan.tu == 0:
            tr = self.transitions[0]
        rev = sorted(plan.revert)
        if plan.kind != "swap" or tr not in self.transitions or plan.non_layer not in self.non_layer \
                or plan.modules not in self.modules or (rev and (not self.revert or rev != list(range(rev[0], rev[-1] + 1)))):
            return None
        p = {"b": plan.b, "u": plan.u, "tb": plan.tb, "tu": plan.tu, "transition": tr, "non_layer": plan.non_layer,
             "modules": plan.modules, "revert_start": rev[0] if rev else 0, "revert_len": len(rev)}
        return p if self.plan(p) == plan else None

    def effect(self, plan: Plan) -> tuple:
        """What the merged model depends on: two plans with the same effect give the same weights."""
        lw = tuple(plan.layer_weights(self.num_layers))
        edges = (plan.non_layer_weight("embed", list(lw)), plan.non_layer_weight("lm_head", list(lw)))
        return lw, edges, plan.modules if any(lw) else "all", tuple(sorted(plan.revert))

    # ---- the optimiser's view ---------------------------------------------------------------------
    def suggest(self, trial) -> dict[str, Any]:
        """Parameters from an Optuna trial (fixed ranges; combinations that do not fit are refused by `plan`)."""
        L = self.num_layers
        p: dict[str, Any] = {"b": trial.suggest_int("b", 0, self.max_b), "u": trial.suggest_int("u", 0, self.max_u),
                             "tb": trial.suggest_int("tb", 0, self.max_t), "tu": trial.suggest_int("tu", 0, self.max_t)}
        for name, choices in (("transition", self.transitions), ("non_layer", self.non_layer),
                              ("modules", self.modules)):
            p[name] = trial.suggest_categorical(name, list(choices)) if len(choices) > 1 else choices[0]
        if self.revert:
            p["revert_start"] = trial.suggest_int("revert_start", 0, L - 1)
            p["revert_len"] = trial.suggest_int("revert_len", 0, L)
        return p

    def trial_params(self, p: dict[str, Any]) -> dict[str, Any]:
        """`p` as the optimiser names it (only the dimensions with a choice)."""
        keep = {"b", "u", "tb", "tu", *(("revert_start", "revert_len") if self.revert else ())}
        keep |= {n for n, c in (("transition", self.transitions), ("non_layer", self.non_layer),
                                ("modules", self.modules)) if len(c) > 1}
        return {k: v for k, v in p.items() if k in keep}

    # ---- every plan -------------------------------------------------------------------------------
    def _counts(self) -> Iterator[tuple[int, int, int, int]]:
        L = self.num_layers
        for b in range(self.max_b + 1):
            for u in range(min(self.max_u, L - b) + 1):
                for tb in range(min(self.max_t, L - b - u) + 1):
                    for tu in range(min(self.max_t, L - b - u - tb) + 1):
                        yield b, u, tb, tu

    def size(self) -> int:
        """How many plans the space holds (without listing them; plans of the same effect counted once each way)."""
        L, mt = self.num_layers, self.max_t
        with_t = without_t = 0
        for b in range(self.max_b + 1):
            for u in range(min(self.max_u, L - b) + 1):
                r = L - b - u
                pairs = sum(min(mt, r - tb) + 1 for tb in range(min(mt, r) + 1))
                without_t += 1
                with_t += pairs - 1
        per = len(self.non_layer) * len(self.modules) * ((1 + L * (L + 1) // 2) if self.revert else 1)
        return (without_t + with_t * len(self.transitions)) * per - self._unchanged_experts()

    def _unchanged_experts(self) -> int:
        """How many parameter sets build an expert unchanged (never plans): only where every layer has one source,
        all from the math expert (no layer swapped) or all from the language expert (every layer swapped)."""
        n = 0
        for b, u, tb, tu in self._counts():
            if 0 < b + u + tb + tu < self.num_layers:
                continue
            for tr in (self.transitions if tb or tu else self.transitions[:1]):
                kind, weight = read_transition(tr)
                for nl in self.non_layer:
                    for mod in self.modules:
                        n += bool(self.unchanged_expert(Plan(b=b, u=u, tb=tb, tu=tu, transition=kind,
                                                             transition_weight=weight, non_layer=nl, modules=mod)))
        return n

    def plans(self) -> Iterator[Plan]:
        """Every plan of the space, in a fixed order (use when `size` is small)."""
        L = self.num_layers
        reverts = [(0, 0)] + ([(s, n) for n in range(1, L + 1) for s in range(L - n + 1)] if self.revert else [])
        for b, u, tb, tu in self._counts():
            for tr in (self.transitions if tb or tu else self.transitions[:1]):
                for nl in self.non_layer:
                    for mod in self.modules:
                        for s, n in reverts:
                            plan = self.plan({"b": b, "u": u, "tb": tb, "tu": tu, "transition": tr, "non_layer": nl,
                                              "modules": mod, "revert_start": s, "revert_len": n})
                            if plan is not None:
                                yield plan


def grid_space(num_layers: int) -> Space:
    """The exhaustive (b, u, tb, tu) grid at the default transition and non-layer choice: what a grid sweep over
    every depth evaluates, the reference a search is compared with."""
    return Space(num_layers, transitions=("flat:0.5",), non_layer=("neighbour",))
