"""The one Ray runner, for sweeps and search: workers (Ray actors), each with its own workbench and the GPUs its
engine spans, run jobs on the experts they are handed; the driver keeps the one results file.

    with Pool(4, EngineSettings(engine="vllm", tensor_parallel_size=2)) as pool:    # 2 GPUs per worker
        for records in pool.unordered(jobs): ...        # jobs: (experts, function, args); function(wb, *args)

`actor_options` decides each worker's resources: its CPUs and, from the engine settings' tensor-parallel size, its
GPUs. A worker keeps the last expert set it loaded between jobs; a family's next member only switches its language
expert in (`Workbench.switch_lang`), as the sequential runner does. `run_sweep_ray` runs a sweep on a pool, writing
the records the sequential runner writes (same keys and contents, apart from timings; lines may come in another
order, `run.sweep_results` gives them in sweep order) under the same resume rules; `search` races candidates on
one. Needs ``pip install ray``; `address` names a running cluster (else a local one is started and stopped).
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path
from typing import Callable, Iterable, Iterator

from layerswap.core.errors import UserError
from layerswap.core.runtime import Progress, no_progress
from layerswap.engines import EngineSettings
from layerswap.sweeps.log import ResultsLog
from layerswap.sweeps.records import layout, ordered, refusal_reason, refused_record
from layerswap.sweeps.run import SweepRun, execute
from layerswap.sweeps.spec import SweepSpec, load_spec

Experts = tuple  # (math, lang, base, force, family): what a worker loads (family: the set's family name, or None)


def need_ray():
    """The `ray` module, or the one line that says how to get it."""
    try:
        import ray
    except ImportError:
        raise UserError("Running on Ray workers needs Ray: pip install ray (or run without --ray).") from None
    return ray


def actor_options(settings: EngineSettings, cpus: float = 1.0, gpus: float | None = None) -> dict:
    """Ray's resources for one worker: `cpus`, and the GPUs its engine spans (`gpus`; default the settings'
    ``tensor_parallel_size`` when above 1, else none). Fewer GPUs than a tensor-parallel engine spans is refused."""
    tp = int(settings.tensor_parallel_size or 1)
    gpus = (tp if tp > 1 else 0.0) if gpus is None else gpus
    if tp > 1 and gpus < tp:
        raise UserError(f"Each worker's vLLM engine spans tensor_parallel_size={tp} GPUs: give each worker {tp} GPUs "
                        f"(--ray-gpus {tp}), not {gpus:g}.")
    if cpus <= 0 or gpus < 0:
        raise UserError(f"A Ray worker needs CPUs > 0 and GPUs >= 0, not {cpus:g} and {gpus:g}.")
    return {"num_cpus": cpus, "num_gpus": gpus}


class Worker:
    """A Ray actor's state: one workbench, loaded with the last expert set it was given."""

    def __init__(self, settings: EngineSettings, threads: int | None = None):
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.settings, self.wb, self.loaded = settings, None, None
        self.loads = self.switches = 0  # how often it loaded experts, and switched a family's language in

    def run(self, experts: Experts, job: Callable, *args):
        """`job(workbench, *args)` with `experts` loaded (loaded again only when they change; a member of the
        family already loaded is switched in)."""
        if self.loaded != experts:
            from layerswap.serving.workbench import Workbench

            math, lang, base, force, family = experts
            held = self.loaded
            if (self.wb is not None and family is not None and (held[0], *held[2:]) == (math, base, force, family)
                    and not self.wb.switch_problem(lang)):  # else (a LoRA rank the engine lacks): loaded afresh
                self.wb.switch_lang(lang, force=force)
                self.switches += 1
            else:
                if self.wb is not None:
                    self.wb.close()
                self.wb = Workbench.from_settings(self.settings)
                self.wb.load(math, lang, base, force=force)
                self.loads += 1
            self.loaded = experts
        return job(self.wb, *args)


def worker_class(settings: EngineSettings, cpus: float = 1.0, gpus: float | None = None):
    """`Worker` as a Ray actor class with the resources of `actor_options` (no cluster needed to make it)."""
    return need_ray().remote(**actor_options(settings, cpus, gpus))(Worker)


class Pool:
    """`size` workers with the resources of `actor_options`; `map` runs one job per worker and returns the results
    in order, `unordered` runs a queue of jobs and yields each result as it comes."""

    def __init__(self, size: int, settings: EngineSettings, *, address: str | None = None, cpus_per_actor: float = 1.0,
                 gpus_per_actor: float | None = None, threads: int | None = 1):
        actor = worker_class(settings, cpus_per_actor, gpus_per_actor)  # refused before any cluster starts
        ray = need_ray()
        if size < 1:
            raise UserError("Running on Ray needs at least one worker.")
        self.ray, self.size, self.started = ray, size, False
        if not ray.is_initialized():
            import layerswap

            root = str(Path(layerswap.__file__).resolve().parent.parent)  # actors import this very package
            ray.init(address=address, num_cpus=None if address else max(1, int(size * cpus_per_actor)),
                     include_dashboard=False, log_to_driver=False, configure_logging=False,
                     runtime_env={"env_vars": {"PYTHONPATH": root}})
            self.started = True
        self.workers = [actor.remote(settings, threads) for _ in range(size)]

    def map(self, jobs: list[tuple[Experts, Callable, tuple]]) -> list:
        """At most `size` jobs, one per worker, their results in job order."""
        refs = [w.run.remote(experts, job, *args) for w, (experts, job, args) in zip(self.workers, jobs)]
        return self.ray.get(refs)

    def unordered(self, jobs: Iterable[tuple[Experts, Callable, tuple]],
                  stop: Callable[[], bool] = lambda: False) -> Iterator:
        """Each job's result as it finishes, a worker taking the next job when it is free; after `stop()` is true no
        job goes out (running ones finish and are yielded)."""
        queue, pending = deque(jobs), {}
        for w in self.workers:
            if queue:
                experts, job, args = queue.popleft()
                pending[w.run.remote(experts, job, *args)] = w
        while pending:
            ready, _ = self.ray.wait(list(pending), num_returns=1)
            w = pending.pop(ready[0])
            yield self.ray.get(ready[0])
            if queue and not stop():
                experts, job, args = queue.popleft()
                pending[w.run.remote(experts, job, *args)] = w

    def close(self) -> None:
        for w in self.workers:
            self.ray.kill(w)
        if self.started:
            self.ray.shutdown()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sweep_job(wb, spec: SweepSpec, s, units) -> list[dict]:
    """A worker's job of a sweep: the records of `units` of expert set `s` (`run.execute`)."""
    records: list[dict] = []
    execute(wb, spec, s, units, records.append)
    return records


def _jobs(units) -> list[list]:
    """Units grouped so that a recipe is merged once: one job per recipe, per expert, or the statistics."""
    groups: dict[tuple, list] = {}
    for u in units:
        groups.setdefault((u.kind, u.point.name if u.point else u.role), []).append(u)
    return list(groups.values())


def run_sweep_ray(spec: SweepSpec | str | Path, out: str | Path, actors: int = 2, progress: Progress | None = None,
                  cancel: threading.Event | None = None, *, gpus_per_actor: float | None = None,
                  cpus_per_actor: float = 1.0, threads: int | None = None, address: str | None = None) -> SweepRun:
    """`run_sweep` on a `Pool` of `actors` workers (GPUs per worker: `actor_options`). `cancel` stops handing out
    jobs; running ones finish and are kept."""
    need_ray()
    if actors < 1:
        raise UserError("A Ray sweep needs at least one actor.")
    spec = spec if isinstance(spec, SweepSpec) else load_spec(spec)
    spec.check_experts()
    settings = EngineSettings.from_dict(spec.engine)
    actor_options(settings, cpus_per_actor, gpus_per_actor)  # before the results file is opened
    p = progress or no_progress
    left_out: dict[str, int] = {}
    with ResultsLog(out) as log:
        plan, refusal = layout(spec, left_out)
        jobs = []
        for s, cks, units in plan:
            todo = [u for u in units if u.key not in log]
            if not todo or refusal[s.name] in log:
                continue
            reason = refusal_reason(s, cks)
            if reason:
                log.append(refused_record(spec, s, cks, refusal[s.name], reason))
                continue
            jobs += [((s.math, s.lang, s.base, s.force, s.family), sweep_job, (spec, s, job)) for job in _jobs(todo)]
        total, ran, done = len(jobs), 0, 0
        stop = (lambda: cancel.is_set()) if cancel is not None else (lambda: False)
        if jobs:  # a sweep whose every point is recorded starts no cluster
            with Pool(min(actors, total), settings, address=address, cpus_per_actor=cpus_per_actor,
                      gpus_per_actor=gpus_per_actor, threads=threads) as pool:
                for records in pool.unordered(jobs, stop):
                    for rec in records:
                        log.append(rec)
                        ran += 1
                    done += 1
                    p(done / total, f"{done}/{total} jobs on {pool.size} actors")
        cancelled = stop()
        p(1.0, "cancelled" if cancelled else "done")
        return SweepRun(spec, Path(out), ordered(plan, refusal, log.rows), cancelled, ran, left_out, log.repaired)
