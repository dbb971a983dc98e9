"""The one evaluation step under sweeps and search: a model on the workbench (a recipe's merge, built when the
merged engine does not hold that recipe yet, or an expert) evaluated, and its record written to the results log.

    m = measure(wb, recipe, config, record=lambda m: {...}, write=log.append)
    m.report, m.layer_weights, m.seconds, m.record

Every caller evaluates through `measure`: `sweeps.run` (each point of a sweep file, on one machine or on the Ray
workers of `sweeps.ray`), `sweeps.inmemory` (points kept in memory, no record) and `search.store` (each chunk of
questions a candidate or a baseline answers). A recipe the experts cannot take raises `Refused` (a `UserError`):
a sweep records it as not run, the others let it through.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from layerswap.core.errors import UserError
from layerswap.core.roles import ROLE_NAMES
from layerswap.core.runtime import Progress, no_progress
from layerswap.evaluation.run import EvalConfig, EvalReport
from layerswap.recipe.recipes import Recipe


class Refused(UserError):
    """The workbench's experts cannot take this recipe (the message says why and what to do)."""


@dataclass
class Measured:
    """One model evaluated: which role answered, its report, the merge's layer weights, the seconds it took
    (building included) and the record written for it (None without one)."""

    role: str  # "merged" or an expert's role
    report: EvalReport
    layer_weights: list[float] | None
    seconds: float
    record: dict | None = None

    @property
    def cancelled(self) -> bool:
        return bool(self.report.cancelled)

    @property
    def model(self) -> str:
        """The model's name in the report (`roles.ROLE_NAMES`)."""
        return ROLE_NAMES[self.role]


def measure(wb, who: Recipe | str, config: EvalConfig, *, record: Callable[[Measured], dict] | None = None,
            write: Callable[[dict], None] | None = None, progress: Progress | None = None,
            cancel: threading.Event | None = None) -> Measured:
    """Evaluate `who` (a recipe: its merge; a role: that expert) on `config` with the workbench `wb`, starting its
    engines when none answer yet; `record(measured)` makes the record that `write` appends (not when cancelled)."""
    p = progress or no_progress
    t = time.perf_counter()
    if not wb.answering:  # a search whose answers are all recorded never gets here
        wb.start()
    role, lw = ("merged", None) if isinstance(who, Recipe) else (who, None)
    if role == "merged":
        if not wb.holds(who):
            p(0.0, "merging")
            try:
                wb.build(who)
            except UserError as e:  # this recipe cannot run on these experts (a merge method on prefixes)
                raise Refused(str(e)) from e
        lw = wb.layer_weights
    rep = wb.evaluate(config, roles=(role,), progress=p, cancel=cancel)
    m = Measured(role, rep, lw, time.perf_counter() - t)
    if record is not None and not m.cancelled:
        m.record = record(m)
        if write is not None:
            write(m.record)
    return m
