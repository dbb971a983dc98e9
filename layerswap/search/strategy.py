"""Which plan to try next: every plan of the space when it fits the budget, else Optuna's TPE seeded with the priors.

Both hand out `(handle, plan, name)` (plan None: the parameters do not fit the model; it is told back
without being evaluated) and hear each outcome back (`tell`): a `race.Race`, or None for an invalid plan.
TPE hears a complete race as its dev score; a race stopped early as pruned, with the score after each rung
it reached as intermediate values (Optuna ranks such trials by how far they got, then by that score); an
invalid plan as pruned with no value (ranked last). Seeded by `seed`, the sequence is deterministic.
"""

from __future__ import annotations

import warnings
from typing import Iterator

from layerswap.core.errors import UserError
from layerswap.search.prior import Prior
from layerswap.search.race import Race
from layerswap.search.space import Space

STRATEGIES = ("auto", "exhaustive", "tpe")


class Exhaustive:
    """The priors, then every plan of the space in its fixed order."""

    name = "exhaustive"

    def __init__(self, space: Space, priors: list[Prior]):
        self._it: Iterator = iter([(p.plan, p.name) for p in priors] + [(pl, "") for pl in space.plans()])

    def ask(self):
        nxt = next(self._it, None)
        return None if nxt is None else (None, nxt[0], nxt[1])

    def tell(self, handle, outcome: Race | None) -> None:
        pass


class TPE:
    """Optuna's TPE sampler (multivariate) over `Space.suggest`'s parameters, the priors enqueued first."""

    name = "tpe"

    def __init__(self, space: Space, priors: list[Prior], seed: int = 0):
        try:
            import optuna
        except ImportError:
            raise UserError("A search larger than its budget runs Optuna: pip install optuna.") from None
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna, self.space = optuna, space
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=10)
        self.study = optuna.create_study(direction="maximize", sampler=sampler)
        self.names: dict[int, str] = {}
        for i, p in enumerate(priors):
            self.study.enqueue_trial(space.trial_params(space.params(p.plan)))
            self.names[i] = p.name

    def ask(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", self.optuna.exceptions.ExperimentalWarning)
            trial = self.study.ask()
            plan = self.space.plan(self.space.suggest(trial))
        return trial, plan, self.names.get(trial.number, "")

    def tell(self, trial, outcome: Race | None) -> None:
        state = self.optuna.trial.TrialState
        if outcome is not None and outcome.complete:
            self.study.tell(trial, outcome.accuracy)
            return
        for n, acc in (outcome.reached if outcome is not None else []):
            trial.report(acc, n)
        self.study.tell(trial, state=state.PRUNED)


def choose(strategy: str, space: Space, priors: list[Prior], budget: int, seed: int):
    """`exhaustive` when asked, or (auto) when the space holds no more plans than the budget; else TPE."""
    if strategy not in STRATEGIES:
        raise UserError(f"strategy is one of {', '.join(STRATEGIES)}, not {strategy!r}.")
    if strategy == "exhaustive" or (strategy == "auto" and space.size() <= budget):
        return Exhaustive(space, priors)
    return TPE(space, priors, seed)
