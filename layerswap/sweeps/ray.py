"""Sweeps on Ray: points run in parallel on engine actors (one per GPU, or per CPU slot), writing the same
results file under the same resume rules as `run.run_sweep`.

    run = run_sweep_ray("assets/sweeps/1-counts.yaml", "results.jsonl", actors=4, gpus_per_actor=1)

The driver holds the results file (`log.ResultsLog`: one writer) and appends each record as an
actor returns it; work goes out as jobs of one recipe (merged once, then evaluated on every test
set), one expert or the statistics of one expert set. An actor keeps its expert set loaded between
jobs. Records are the ones the sequential runner writes (same keys and contents, apart from
timings); lines may come in another order, `run.sweep_results` gives them in sweep order.
Needs ``pip install ray``; the single-machine `run_sweep` does not.
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path

from layerswap.core.errors import UserError
from layerswap.core.runtime import Progress, no_progress
from layerswap.sweeps.log import ResultsLog
from layerswap.sweeps.records import layout, ordered, refusal_reason, refused_record
from layerswap.sweeps.run import SweepRun, execute, workbench_for
from layerswap.sweeps.spec import SweepSpec, load_spec


class SweepWorker:
    """A Ray actor's state: one Workbench, loaded with the last expert set it was given."""

    def __init__(self, spec: SweepSpec, threads: int | None = None):
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.spec, self.wb, self.loaded = spec, None, None

    def run(self, s, units) -> list[dict]:
        if self.loaded != s.name:
            if self.wb is not None:
                self.wb.close()
            self.wb = workbench_for(self.spec)
            self.wb.load(s.math, s.lang, s.base, force=s.force)
            self.loaded = s.name
        return list(execute(self.wb, self.spec, s, units))


def _jobs(units) -> list[list]:
    """Units grouped so that a recipe is merged once: one job per recipe, per expert, or the statistics."""
    groups: dict[tuple, list] = {}
    for u in units:
        groups.setdefault((u.kind, u.point.name if u.point else u.role), []).append(u)
    return list(groups.values())


def run_sweep_ray(spec: SweepSpec | str | Path, out: str | Path, actors: int = 2, progress: Progress | None = None,
                  cancel: threading.Event | None = None, *, gpus_per_actor: float | None = None,
                  cpus_per_actor: float = 1.0, threads: int | None = None, address: str | None = None) -> SweepRun:
    """`run_sweep` with `actors` Ray actors (a local cluster is started, and stopped afterwards, unless one
    is running or `address` names one). `cancel` stops handing out jobs; running ones finish and are kept.
    `gpus_per_actor` defaults to the sweep's ``engine: tensor_parallel_size`` when that is above 1, else 0."""
    try:
        import ray
    except ImportError:
        raise UserError("Parallel sweeps run on Ray: pip install ray (or run the sweep without --ray).") from None
    if actors < 1:
        raise UserError("A Ray sweep needs at least one actor.")
    spec = spec if isinstance(spec, SweepSpec) else load_spec(spec)
    spec.check_experts()
    tp = int(spec.engine.get("tensor_parallel_size") or 1)
    gpus_per_actor = (tp if tp > 1 else 0.0) if gpus_per_actor is None else gpus_per_actor
    if tp > 1 and gpus_per_actor < tp:
        raise UserError(f"Each actor's vLLM engine spans tensor_parallel_size={tp} GPUs: give each actor {tp} GPUs "
                        f"(--ray-gpus {tp}), not {gpus_per_actor:g}.")
    p = progress or no_progress
    started = False
    if not ray.is_initialized():
        import layerswap

        root = str(Path(layerswap.__file__).resolve().parent.parent)  # actors import this very package
        ray.init(address=address, num_cpus=None if address else max(1, int(actors * cpus_per_actor)),
                 include_dashboard=False, log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": root}})
        started = True
    left_out: dict[str, int] = {}
    try:
        with ResultsLog(out) as log:
            plan, refusal = layout(spec, left_out)
            jobs: deque = deque()
            for s, cks, units in plan:
                todo = [u for u in units if u.key not in log]
                if not todo or refusal[s.name] in log:
                    continue
                reason = refusal_reason(s, cks)
                if reason:
                    log.append(refused_record(spec, s, cks, refusal[s.name], reason))
                    continue
                jobs.extend((s, job) for job in _jobs(todo))
            total, ran, cancelled = len(jobs), 0, False
            Worker = ray.remote(num_cpus=cpus_per_actor, num_gpus=gpus_per_actor)(SweepWorker)
            workers = [Worker.remote(spec, threads) for _ in range(min(actors, max(total, 1)))]
            pending: dict = {}
            for w in workers:
                if jobs:
                    s, job = jobs.popleft()
                    pending[w.run.remote(s, job)] = w
            done_jobs = 0
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                w = pending.pop(ready[0])
                for rec in ray.get(ready[0]):
                    log.append(rec)
                    ran += 1
                done_jobs += 1
                p(done_jobs / max(total, 1), f"{done_jobs}/{total} jobs on {len(workers)} actors")
                if cancel is not None and cancel.is_set():
                    cancelled = True
                elif jobs:
                    s, job = jobs.popleft()
                    pending[w.run.remote(s, job)] = w
            for w in workers:
                ray.kill(w)
            p(1.0, "cancelled" if cancelled else "done")
            return SweepRun(spec, Path(out), ordered(plan, refusal, log.rows), cancelled, ran, left_out, log.repaired)
    finally:
        if started:
            ray.shutdown()
