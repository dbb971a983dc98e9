"""The search driver: split, priors, strategy, successive halving, records, the held-out evaluation.

    result = search("math/", "lang/", "base/", SearchConfig(langs=["sw"], budget=40))
    print(result.text()); json.dump(result.to_dict(), open("out.json", "w"))

The experts are loaded once into one workbench (`Workbench.from_settings`); each candidate is an in-memory
merge and a live refresh of its merged engine (`Workbench.build`), never a new engine. Every chunk of
questions a model answers is a record in the results file (`store`), appended and fsynced at once, so a
killed search run again with the same settings replays the same decisions from the file and answers
nothing twice. With `workers` (Ray workers, `sweeps.ray.Pool`, the one runner sweeps use too) candidates are raced
in batches of that size, each against the best plan at the start of its batch.

Honest by construction (`for_models`): models that bring their own dev questions (a shipped organism's
``mgsm/dev``, `organisms.choice`) are searched on those, with the answer length their card chose with, never on
their test set; the held-out questions are the test set's. The baselines include the models' own recommended
plan (`organisms.opening_plan`). A search whose every answer is recorded starts no engine: engines start when a
question must be answered.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from layerswap.evaluation import mgsm
from layerswap.shipped import organisms
from layerswap.core.bounds import MAX_LAYERS
from layerswap.models.cache import cache_dir
from layerswap.engines import EngineSettings
from layerswap.core.errors import UserError
from layerswap.recipe.plans import NON_LAYER_OPTIONS, Plan
from layerswap.recipe.recipes import Recipe
from layerswap.core.runtime import Progress, no_progress
from layerswap.sweeps.log import ResultsLog
from layerswap.search.prior import priors as prior_plans
from layerswap.search.race import Z, Race, rungs
from layerswap.search.report import SearchResult, Trial, accuracy, compare
from layerswap.search.space import TRANSITIONS, Space
from layerswap.search.split import split_questions
from layerswap.search.store import Answers, Identity, Tally, identities, model_of, race_job, race_plan, scorer
from layerswap.search.strategy import choose

MAX_BUDGET = 10_000


@dataclass
class SearchConfig:
    """What to search, on which questions, how hard. `budget`: plans evaluated (each on at least the first rung)."""

    langs: list[str]
    source: str | None = None  # MGSM folder (None: the models' own set, else $LAYERSWAP_MGSM_DIR, else the Hub)
    dev_source: str | None = None  # dev questions' folder (None: the models' own dev file, else drawn from source)
    budget: int = 40
    seed: int = 0
    dev: int | None = None  # dev questions per language (default 40 % of the set, at most 400)
    test: int | None = None  # held-out questions (default: the rest of the set)
    strategy: str = "auto"  # auto, exhaustive, tpe
    halving: bool = True
    first_rung: int | None = None
    z: float = Z
    shots: int = mgsm.TASK.shots
    mode: str = mgsm.TASK.mode
    max_new_tokens: int | None = None  # None: what the models' plan was chosen with, else mgsm.MAX_NEW_TOKENS
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
        return {"shots": self.shots, "mode": self.mode, "max_new_tokens": self.max_new_tokens or mgsm.MAX_NEW_TOKENS}


def _same(a, b) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, TypeError):
        return False


def for_models(cfg: SearchConfig, math: str, lang: str, base: str | None = None) -> SearchConfig:
    """`cfg` with what the models bring filled in: their own MGSM set when no source is given, and, when the
    search tests on that set, their dev file (`organisms.choice`), its question count and answer length for the
    values not given. Other models keep `cfg` (their split is drawn from the set)."""
    own = organisms.test_set(math, lang, base)
    source = cfg.source if cfg.source is not None else (str(own) if own is not None else None)
    cfg = replace(cfg, source=source)
    ch = organisms.choice((base or "", math, lang))
    if cfg.dev_source is not None or ch is None or own is None or not _same(source, own):
        return cfg
    return replace(cfg, dev_source=str(ch.dev), dev=cfg.dev if cfg.dev is not None else ch.questions,
                   max_new_tokens=cfg.max_new_tokens or ch.max_new_tokens)


def default_results() -> Path:
    """Where searches keep their records when not told: one file shared by every search on this machine (the CLI's
    and the page's; its folder made on first use)."""
    folder = cache_dir("search")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "results.jsonl"


def _clock(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 60}m{s % 60:02d}s"


def search(math: str, lang: str, base: str | None = None, config: SearchConfig | None = None, *,
           results: str | Path | None = None, engine: EngineSettings | None = None, force: bool = False,
           progress: Progress | None = None, cancel: threading.Event | None = None, workbench=None,
           workers: int = 0, address: str | None = None, gpus_per_worker: float | None = None) -> SearchResult:
    """Search the plan space for `config.langs` (see the module docstring). `workbench`: a loaded one to use (the
    app's); else one is made from `engine` and closed afterwards. `workers` > 0 races candidates on Ray workers
    (`sweeps.ray.Pool`, each with the GPUs its engine spans or `gpus_per_worker`; `address`: a running cluster's).
    `cancel` stops after the current chunk, keeping what was found."""
    cfg = for_models(config or SearchConfig(langs=["sw"]), math, lang, base)
    cfg.validate()
    p = progress or no_progress
    t0 = time.perf_counter()
    split = split_questions(cfg.langs, cfg.source, cfg.seed, cfg.dev, cfg.test, cfg.dev_source)
    from layerswap.evaluation.run import EvalConfig

    EvalConfig(langs=list(cfg.langs), ids=split.dev[:1], source=cfg.dev_source or cfg.source, **cfg.evals()).validate()
    settings = engine or EngineSettings()  # a workbench's (and each Ray actor's): its check asks `choose_engines`
    own = workbench is None
    if own:
        from layerswap.serving.workbench import Workbench

        workbench = Workbench.from_settings(settings)
    wb = workbench
    path = Path(results) if results is not None else default_results()
    try:
        if own:  # headers only: engines start when a question must be answered (`store.scorer`)
            p(0.0, "reading the experts")
            wb.check(math, lang, base, force=force)
        space = cfg.space(wb.num_layers)
        if space.revert and "base" not in wb.checkpoints:
            raise UserError("Searching reverted ranges needs the base model: give --base.")
        test_ident, ident = identities(wb, cfg, force)
        opening = organisms.opening_plan((base or "", math, lang), wb.num_layers)
        an = wb.analysis() if "base" in wb.checkpoints else None
        pri = prior_plans(space, an, opening)
        with ResultsLog(path) as log:
            answers = Answers.from_rows(log.rows.values())
            strat = choose(cfg.strategy, space, pri, cfg.budget, cfg.seed)
            sizes = rungs(len(split.dev), cfg.first_rung) if cfg.halving else [len(split.dev)]
            pool = None
            if workers:
                from layerswap.sweeps.ray import Pool

                pool = Pool(workers, settings, address=address, gpus_per_actor=gpus_per_worker)
            try:
                out = _loop(wb, cfg, ident, split, sizes, strat, answers, log, p, cancel, t0, pool,
                            (math, lang, base, force, None))
            finally:
                if pool is not None:
                    pool.close()
            trials, best, stats, cancelled = out
            test, baselines = None, []
            if best is not None and not cancelled:
                p(0.97, "scoring the plan found and the baselines on the held-out questions")
                test, baselines, cancelled = _held_out(wb, test_ident, split, best.plan, opening, answers, log,
                                                       stats, cancel, p)
            if best is not None and not own:
                wb.ensure_built(best.plan)  # the caller's merged model answers with what was found
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


def _rank(t: Trial) -> tuple[float, int]:
    """The one choice rule, the card's too (`demo_results.ResultsWriter.best_dev`): the highest dev accuracy; a
    tie goes to the plan that swaps fewer layers (then to the one found first)."""
    return t.race.accuracy, -(t.plan.b + t.plan.u + t.plan.tb + t.plan.tu)


def _loop(wb, cfg: SearchConfig, ident: Identity, split, sizes, strat, answers: Answers, log, p, cancel, t0, pool,
          experts: tuple):
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

    batch = pool.size if pool is not None else 1
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
        if pool is not None:
            races = []
            for r, records, t in pool.map([(experts, race_job, (ident, j[1], j[2], answers.known.setdefault(k, {}),
                                                                 list(split.dev), list(sizes), inc, cfg.z))
                                           for j, k in zip(jobs, keys)]):
                races.append(r)
                for rec in records:
                    write(rec)
                    answers.add(rec)
                tally.looked += t.looked
                tally.run += t.run
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
            if r.complete and (best is None or _rank(t) > _rank(best)):
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


def _held_out(wb, ident: Identity, split, plan: Plan, opening, answers: Answers, log, stats: dict, cancel,
              p: Progress = no_progress):
    """The plan and the baselines (math expert, language expert, the models' own opening plan) on the test
    questions, the progress moving with every batch answered (0.97 to 1)."""
    tally = Tally()
    who = [("plan", Recipe(plan=plan)), ("the math expert", "math"), ("the language expert", "lang")]
    if opening.plan != plan:
        what = "recommended" if "recommended" in opening.why else "default"
        who.append((f"the {what} plan ({opening.plan.title()})", Recipe(plan=opening.plan)))
    got: dict[str, dict[str, list[bool]]] = {}
    n = len(who)
    for k, (name, model) in enumerate(who):
        def tick(f: float, d: str = "", k=k, name=name) -> None:
            p(0.97 + 0.03 * (k + min(max(f, 0.0), 1.0)) / n, f"held-out questions: {name} ({k + 1}/{n}), "
                                                             f"{100 * min(max(f, 0.0), 1.0):.0f} %")
        tick(0.0)
        known = answers.known.setdefault(ident.model_key(model_of(model)), {})
        score = scorer(wb, ident, model, known, tally, log.append, cancel, name=name, progress=tick)
        if score(list(split.test)) is None:
            return None, [], True
        got[name] = {lang: [known[(lang, i)] for i in split.test] for lang in ident.langs}
    stats.update(test_questions=tally.looked, test_questions_run=tally.run)
    return accuracy(got["plan"]), [compare(nm, got["plan"], got[nm]) for nm, _ in who[1:]], False
