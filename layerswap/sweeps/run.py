"""The resumable sweep runner: many recipes merged with experts loaded once, each evaluated, every finished
point kept on disk.

    run = run_sweep("assets/sweeps/1-counts.yaml", "results.jsonl", progress=print)
    rows = load_results("results.jsonl")          # also while a sweep runs, or after it was killed

`run_sweep` takes a sweep file or `SweepSpec` (`spec`): for each expert set it loads the experts once (a family's
next member only switches its language expert in, `Workbench.switch_lang`: the math expert stays loaded),
evaluates them as reference rows, then merges each recipe in memory (or refreshes the serving vLLM
engine) and evaluates it on each test set. Each finished point is one record (`records`) appended to the
results file and fsynced (`log`), with its full recipe, the experts' fingerprints and the evaluation
settings; a rerun skips what the file holds, so an interrupted sweep (Ctrl-C, SIGKILL, power loss
mid-write) resumes without losing or repeating a point. An expert set that cannot be merged (different
shapes, or a different base without ``force``) is recorded as refused, with the reason.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from layerswap.core.roles import EXPERTS
from layerswap.core.runtime import Progress, no_progress
from layerswap.sweeps import loop
from layerswap.sweeps.log import ResultsLog, load_results
from layerswap.sweeps.records import (NOT_RUN, Unit, evaluation_fields, layout, ordered, record, refusal_reason,
                                      refused_record)
from layerswap.sweeps.spec import ExpertSet, SweepSpec, load_spec


@dataclass
class SweepRun:
    """What `run_sweep` did: the records of this sweep's points (in sweep order) and how it ended."""

    spec: SweepSpec
    path: Path | None
    rows: list[dict]
    cancelled: bool = False
    ran: int = 0  # points computed by this call (the rest were in the file already)
    left_out: dict[str, int] = field(default_factory=dict)  # expert set -> grid points that did not fit
    repaired: str | None = None  # the damaged last line this call cut off and redid


def workbench_for(spec: SweepSpec):
    """The workbench of the sweep's ``engine:`` settings (`Workbench.from_settings`), here and on Ray workers: its
    `check` asks the one engine decision (`engines.choice.choose_engines`)."""
    from layerswap.engines import EngineSettings
    from layerswap.serving.workbench import Workbench

    return Workbench.from_settings(EngineSettings.from_dict(spec.engine))


def _stats(wb) -> dict:
    """Each expert's distance from the base: sampled (the shared-base check) and over every weight."""
    out: dict = {"pairing": {"distances": wb.pairing.distances, "threshold": wb.pairing.threshold,
                             "suspicious": bool(wb.pairing.suspicious)}}
    if "base" in wb.checkpoints:
        summ = wb.analysis().summary()
        out["relative_change"] = {r: summ[f"relative_{r}"] for r in EXPERTS}
        out["cosine"] = summ["cosine"]
    return out


def execute(wb, spec: SweepSpec, s: ExpertSet, units: list[Unit], write: Callable[[dict], None],
            cancel: threading.Event | None = None, tell: Callable[[float, str], None] = no_progress) -> None:
    """`write` the records of `units` of expert set `s`, with `wb` holding its experts, each evaluation through
    `loop.measure`; stops early when `cancel` is set."""
    for u in units:
        if cancel is not None and cancel.is_set():
            return
        t = time.perf_counter()
        if u.kind == "stats":
            tell(0.0, f"{s.name}: distances from the base")
            write(record(spec, s, u, **_stats(wb), seconds=time.perf_counter() - t))
            continue

        def fields(m: loop.Measured, u: Unit = u) -> dict:
            extra = {}
            if m.role == "merged":
                plan = u.point.recipe.plan
                extra = {"layer_weights": m.layer_weights, "reverted": sorted(plan.reverted()) if plan else [],
                         "pairing_forced": bool(wb.pairing.suspicious)}
            return record(spec, s, u, **evaluation_fields(m.report, m.model), **extra, engine_note=wb.engine_note,
                          seconds=m.seconds)

        try:
            m = loop.measure(wb, u.point.recipe if u.kind == "merge" else u.role,
                             u.test.config(spec.eval_settings()), record=fields, write=write,
                             progress=lambda f, d, n=u.name: tell(f, f"{n}: {d}"), cancel=cancel)
        except loop.Refused as e:
            write(record(spec, s, u, kind=NOT_RUN, message=str(e), seconds=time.perf_counter() - t))
            continue
        if m.cancelled:
            return


def sweep_results(spec: SweepSpec | str | Path, out: str | Path) -> list[dict]:
    """The records a results file holds for this sweep's points, in sweep order (nothing is run or loaded
    beyond checkpoint headers); several sweeps may share one results file."""
    spec = spec if isinstance(spec, SweepSpec) else load_spec(spec)
    spec.check_experts()
    plan, refusal = layout(spec, {})
    return ordered(plan, refusal, {r["key"]: r for r in load_results(out)})


def run_sweep(spec: SweepSpec | str | Path, out: str | Path | None, progress: Progress | None = None,
              cancel: threading.Event | None = None, *, workbench: Callable[[SweepSpec], object] | None = None,
              ) -> SweepRun:
    """Run (or resume) a sweep, appending each finished point to the results file `out` (None: a
    temporary file, removed afterwards). `progress(fraction, text)` hears about every step from the first
    second (the count of points, what is loading), with an ETA from the points measured in this call only (their
    records' ``seconds``; loading the experts is not a point); `cancel` stops after the current batch (what is finished is kept)."""
    spec = spec if isinstance(spec, SweepSpec) else load_spec(spec)
    spec.check_experts()
    p = progress or no_progress
    tmp = Path(tempfile.mkdtemp(prefix="layerswap-sweep-")) if out is None else None
    path = Path(out) if out is not None else tmp / "results.jsonl"
    make = workbench or workbench_for
    left_out: dict[str, int] = {}
    try:
        with ResultsLog(path) as log:
            plan, refusal = layout(spec, left_out)
            total = sum(len(us) for _, _, us in plan)
            done = sum(len(us) if refusal[s.name] in log else sum(u.key in log for u in us) for s, _, us in plan)
            ran, measured, cancelled = 0, 0.0, False  # points run now, and the seconds they took

            def tell(f: float, what: str) -> None:
                eta = f" · ETA {_clock(measured / ran * (total - done - f))}" if ran else ""
                p(min(1.0, (done + f) / max(total, 1)), f"{done}/{total} points{eta} · {what}")

            def keep(rec: dict) -> None:
                nonlocal done, ran, measured
                log.append(rec)
                done += 1
                ran += 1
                measured += rec["seconds"]  # what the point took, as its record says

            tell(0.0, f"{done} already in the results file" if done else "starting")

            wb, held = None, None  # a family's next member switches its language expert in: math loaded once
            try:
                for s, cks, units in plan:
                    todo = [u for u in units if u.key not in log]
                    if not todo or cancelled or refusal[s.name] in log:
                        continue
                    reason = refusal_reason(s, cks)
                    if reason:  # different shapes, or a different base without force
                        log.append(refused_record(spec, s, cks, refusal[s.name], reason))
                        done += len(todo)
                        continue
                    say = lambda f, d, n=s.name: tell(0.0, f"{n}: loading the experts: {d}")  # noqa: E731
                    family = wb is not None and held == (s.family, s.math, s.base, s.force)
                    if family and not wb.switch_problem(s.lang):  # else (a LoRA rank it lacks): loaded afresh
                        tell(0.0, f"{s.name}: switching to its language expert")
                        wb.switch_lang(s.lang, force=s.force, progress=say)
                    else:
                        if wb is not None:
                            wb.close()
                        wb = make(spec)
                        tell(0.0, f"{s.name}: loading the experts")
                        wb.load(s.math, s.lang, s.base, force=s.force, progress=say)
                    held = (s.family, s.math, s.base, s.force) if s.family else None
                    execute(wb, spec, s, todo, keep, cancel, tell)
                    cancelled = cancel is not None and cancel.is_set()
            finally:
                if wb is not None:
                    wb.close()
            rows = ordered(plan, refusal, log.rows)
            p(1.0, "cancelled" if cancelled else "done")
            return SweepRun(spec, None if tmp else path, rows, cancelled, ran, left_out, log.repaired)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


