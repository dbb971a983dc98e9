"""Candidates raced on Ray actors: each actor loads the experts once into its own workbench and races the plans it
is handed (merge in memory, refresh its engine, answer); the driver keeps the one results file.

A batch of `size` candidates goes out at once, each raced against the best plan at the batch's start; the
answers already known for a candidate travel with it, and its new records come back to be written. Needs
``pip install ray``; `address` names a running cluster (else a local one is started and stopped).
"""

from __future__ import annotations

from pathlib import Path

from layerswap.core.errors import UserError
from layerswap.search.store import Tally, race_plan


class SearchWorker:
    """A Ray actor's state: one workbench with the experts loaded."""

    def __init__(self, settings, refs, threads: int | None = None):
        if threads:
            import torch

            torch.set_num_threads(threads)
        from layerswap.serving.workbench import Workbench

        math, lang, base, force = refs
        self.wb = Workbench.from_settings(settings)
        self.wb.load(math, lang, base, force=force)

    def race(self, ident, plan, name, known, dev, sizes, incumbent, z):
        records: list[dict] = []
        tally = Tally()
        r = race_plan(self.wb, ident, plan, name, dict(known), dev, sizes, incumbent, z, records.append, tally)
        return r, records, tally


class RayRunner:
    """`size` actors; `races` runs one batch of candidates on them and returns races and records in job order."""

    def __init__(self, size: int, settings, refs, address: str | None = None, cpus_per_actor: float = 1.0):
        try:
            import ray
        except ImportError:
            raise UserError("Searching on Ray workers needs Ray: pip install ray (or search without --ray).") from None
        if size < 1:
            raise UserError("A search on Ray needs at least one worker.")
        self.ray, self.size, self.started = ray, size, False
        if not ray.is_initialized():
            import layerswap

            root = str(Path(layerswap.__file__).resolve().parent.parent)  # actors import this very package
            ray.init(address=address, num_cpus=None if address else max(1, int(size * cpus_per_actor)),
                     include_dashboard=False, log_to_driver=False, configure_logging=False,
                     runtime_env={"env_vars": {"PYTHONPATH": root}})
            self.started = True
        Worker = ray.remote(num_cpus=cpus_per_actor)(SearchWorker)
        self.workers = [Worker.remote(settings, refs, 1) for _ in range(size)]

    def races(self, ident, jobs, dev, sizes, incumbent, z, tally: Tally):
        refs = [w.race.remote(ident, plan, name, known, list(dev), list(sizes), incumbent, z)
                for w, (plan, name, known) in zip(self.workers, jobs)]
        races, records = [], []
        for (plan, name, known), (r, recs, t) in zip(jobs, self.ray.get(refs)):
            races.append(r)
            records += recs
            tally.looked += t.looked
            tally.run += t.run
        return races, records

    def close(self) -> None:
        for w in self.workers:
            self.ray.kill(w)
        if self.started:
            self.ray.shutdown()
