"""The search driver: split, priors, strategy, successive halving, records, the held-out evaluation.

    result = search("math/", "lang/", "base/", SearchConfig(langs=["sw"], budget=40))
    print(result.text()); json.dump(result.to_dict(), open("out.json", "w"))

The experts are loaded once into one workbench (`Workbench.from_settings`); each candidate is an in-memory
merge and a live refresh of its merged engine (`Workbench.build`), never a new engine. Every chunk of
questions a model answers is a record in the results file (`store`), appended and fsynced at once, so a
killed search run again with the same settings replays the same decisions from the file and answers
nothing twice. With `workers` (Ray actors, `search.ray`) candidates are raced in batches of that size,
each against the best plan at the start of its batch.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .. import mgsm
from ..bounds import MAX_LAYERS
from ..cache import cache_dir
from ..engines import EngineSettings
from ..errors import UserError
from ..plans import NON_LAYER_OPTIONS, Plan, default_plan
from ..recipes import Recipe
from ..runtime import Progress, no_progress
from ..sweeps.log import ResultsLog
from .prior import priors as prior_plans
from .race import Z, Race, rungs
from .report import SearchResult, Trial, accuracy, compare
from .space import TRANSITIONS, Space
from .split import split_questions
from .store import Answers, Identity, Tally, model_of, race_plan, scorer
from .strategy import choose

MAX_BUDGET = 10_000


@dataclass
class SearchConfig:
    """What to search, on which questions, how hard. `budget`: plans evaluated (each on at least the first rung)."""

    langs: list[str]
    source: str | None = None  # MGSM folder (None: $LAYERSWAP_MGSM_DIR, else the Hub)
    budget: int = 40
    seed: int = 0
    dev: int | None = None  # dev questions per language (default 40 % of the set, at most 400)
    test: int | None = None  # held-out questions (default: the rest of the set)
    strategy: str = "auto"  # auto, exhaustive, tpe
    halving: bool = True
    first_rung: int | None = None
    z: float = Z
    shots: int = 0
    mode: str = "native_cot"
    max_new_tokens: int = mgsm.MAX_NEW_TOKENS
    max_b: int | None = None
    max_u: int | None = None
    max_t: int | None = None
    transitions: tuple[str, ...] = TRANSITIONS
    non_layer: tuple[str, ...] = NON_LAYER_OPTIONS
    module_wise: bool = False
    revert: bool = False

    def validate(self) -> None:
        if not isinstance(self.budget, int) or not 1 <= self.budget <= MAX_BUDGET:
            raise UserError(f"budget is a number of plans from 1 to {MAX_BUDGET:,}, not {self.budget!r}.")
        if not 0 < self.z <= 10:
            raise UserError(f"z (paired standard errors behind before a candidate stops) is in (0, 10], not {self.z!r}.")
        for k in ("max_b", "max_u", "max_t"):
            v = getattr(self, k)
            if v is not None and not (isinstance(v, int) and 0 <= v <= MAX_LAYERS):
                raise UserError(f"{k} is a number of layers from 0 to {MAX_LAYERS}, not {v!r}.")

    def space(self, num_layers: int) -> Space:
        return Space(num_layers, self.max_b, self.max_u, self.max_t, tuple(self.transitions), tuple(self.non_layer),
                     self.module_wise, self.revert)

    def evals(self) -> dict:
        return {"shots": self.shots, "mode": self.mode, "max_new_tokens": self.max_new_tokens}


def default_results() -> Path:
    """Where searches keep their records when not told: one file shared by every search on this machine."""
    return cache_dir("search") / "results.jsonl"


def _clock(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 60}m{s % 60:02d}s"


def search(math: str, lang: str, base: str | None = None, config: SearchConfig | None = None, *,
           results: str | Path | None = None, engine: EngineSettings | None = None, force: bool = False,
           progress: Progress | None = None, cancel: threading.Event | None = None, workbench=None,
           workers: int = 0, address: str | None = None) -> SearchResult:
    """Search the plan space for `config.langs` (see the module docstring). `workbench`: a loaded one to use (the
    app's); else one is made from `engine` and closed afterwards. `workers` > 0 races candidates on Ray actors
    (`address`: a running cluster's). `cancel` stops after the current chunk, keeping what was found."""
    cfg = config or SearchConfig(langs=["sw"])
    cfg.validate()
    p = progress or no_progress
    t0 = time.perf_counter()
    split = split_questions(cfg.langs, cfg.source, cfg.seed, cfg.dev, cfg.test)
    from ..evaluation import EvalConfig

    EvalConfig(langs=list(cfg.langs), ids=split.dev[:1], source=cfg.source, **cfg.evals()).validate()
    settings = engine or EngineSettings()
    own = workbench is None
    if own:
        from ..workbench import Workbench

        workbench = Workbench.from_settings(settings)
    wb = workbench
    path = Path(results) if results is not None else default_results()
    try:
        if own:
            p(0.0, "loading the experts")
            wb.load(math, lang, base, force=force)
        space = cfg.space(wb.num_layers)
        if space.revert and "base" not in wb.checkpoints:
            raise UserError("Searching reverted ranges needs the base model: give --base.")
        ident = Identity.of(wb.checkpoints, force, cfg.source, cfg.evals(),
                            {"engine": settings.engine, "chat_template": settings.chat_template}, cfg.langs)
        an = wb.analysis() if "base" in wb.checkpoints else None
        pri = prior_plans(space, an)
        with ResultsLog(path) as log:
            answers = Answers.from_rows(log.rows.values())
            strat = choose(cfg.strategy, space, pri, cfg.budget, cfg.seed)
            sizes = rungs(len(split.dev), cfg.first_rung) if cfg.halving else [len(split.dev)]
            runner = None
            if workers:
                from .ray import RayRunner

                runner = RayRunner(workers, settings, (math, lang, base, force), address)
            try:
                out = _loop(wb, cfg, ident, split, sizes, strat, answers, log, p, cancel, t0, runner)
            finally:
                if runner is not None:
                    runner.close()
            trials, best, stats, cancelled = out
            test, baselines = None, []
            if best is not None and not cancelled:
                p(0.97, "scoring the plan found and the baselines on the held-out questions")
                test, baselines, cancelled = _held_out(wb, ident, split, best.plan, answers, log, stats, cancel)
            if best is not None and not own and wb.recipe != Recipe(plan=best.plan):
                wb.build(best.plan)  # the caller's merged model answers with what was found
    finally:
        if own:
            wb.close()
    dev = {"n": 0, "questions": 0, "accuracy": 0.0}
    if best is not None:
        dev = {"n": len(split.dev) * len(cfg.langs), "questions": len(split.dev), "accuracy": round(best.race.accuracy, 4),
               "optimistic": f"the best of {stats['plans']} plans chosen on these questions"}
    p(1.0, "stopped" if cancelled else "done")
    return SearchResult(None if best is None else best.plan, dev, test, baselines, stats, split, strat.name, space,
                        pri, trials, time.perf_counter() - t0, str(path), cancelled, cfg.source)


def _loop(wb, cfg: SearchConfig, ident: Identity, split, sizes, strat, answers: Answers, log, p, cancel, t0, runner):
    """Ask, race, tell until the budget is spent, the space is exhausted, or `cancel`."""
    space = cfg.space(wb.num_layers)
    tally = Tally()
    seen: dict[tuple, Race] = {}
    trials: list[Trial] = []
    best: Trial | None = None
    invalid = dups = asks = 0
    cancelled = False

    def write(rec: dict) -> None:
        log.append(rec)

    batch = runner.size if runner is not None else 1
    while len(trials) < cfg.budget and asks < 100 * cfg.budget + 1000:
        if cancel is not None and cancel.is_set():
            cancelled = True
            break
        jobs = []  # (handle, plan, name) to race in this batch
        while len(jobs) < min(batch, cfg.budget - len(trials)) and asks < 100 * cfg.budget + 1000:
            item = strat.ask()
            if item is None:
                break
            asks += 1
            handle, plan, name = item
            if plan is None:
                invalid += 1
                strat.tell(handle, None)
                continue
            e = space.effect(plan)
            if e in seen or any(space.effect(j[1]) == e for j in jobs):
                dups += 1
                strat.tell(handle, seen.get(e))
                continue
            jobs.append(item)
        if not jobs:
            break
        inc = best.race.scores if best is not None else None
        keys = [ident.model_key(model_of(Recipe(plan=j[1]))) for j in jobs]
        if runner is not None:
            races, records = runner.races(ident, [(j[1], j[2], answers.known.setdefault(k, {}))
                                                  for j, k in zip(jobs, keys)], split.dev, sizes, inc, cfg.z, tally)
            for r in records:
                write(r)
                answers.add(r)
        else:
            races = [race_plan(wb, ident, jobs[0][1], jobs[0][2], answers.known.setdefault(keys[0], {}), split.dev,
                               sizes, inc, cfg.z, write, tally, cancel)]
        for (handle, plan, name), r in zip(jobs, races):
            if r.cancelled:
                cancelled = True
                continue
            strat.tell(handle, r)
            seen[space.effect(plan)] = r
            t = Trial(name, plan, r)
            trials.append(t)
            if r.complete and (best is None or r.accuracy > best.race.accuracy):
                best = t
        if cancelled:
            break
        k = len(trials)
        left = (time.perf_counter() - t0) / max(k, 1) * (cfg.budget - k)
        where = f"best so far: {best.plan.title()}, {100 * best.race.accuracy:.1f} % on dev" if best else "no plan yet"
        p(min(0.95, 0.95 * k / cfg.budget), f"{k}/{cfg.budget} plans · {where} · about {_clock(left)} left")
    stats = {"plans": len(trials), "questions": tally.looked, "questions_run": tally.run,
             "questions_reused": tally.looked - tally.run, "invalid": invalid, "duplicates": dups,
             "budget": cfg.budget, "rungs": list(sizes), "z": cfg.z}
    return trials, best, stats, cancelled


def _held_out(wb, ident: Identity, split, plan: Plan, answers: Answers, log, stats: dict, cancel):
    """The plan and the baselines (math expert, language expert, default plan) on the test questions."""
    tally = Tally()
    who = [("plan", Recipe(plan=plan)), ("the math expert", "math"), ("the language expert", "lang")]
    dp = default_plan(wb.num_layers)
    if dp != plan:
        who.append((f"the default plan ({dp.title()})", Recipe(plan=dp)))
    got: dict[str, dict[str, list[bool]]] = {}
    for name, model in who:
        known = answers.known.setdefault(ident.model_key(model_of(model)), {})
        if scorer(wb, ident, model, known, tally, log.append, cancel, name=name)(list(split.test)) is None:
            return None, [], True
        got[name] = {lang: [known[(lang, i)] for i in split.test] for lang in ident.langs}
    stats.update(test_questions=tally.looked, test_questions_run=tally.run)
    return accuracy(got["plan"]), [compare(n, got["plan"], got[n]) for n, _ in who[1:]], False
