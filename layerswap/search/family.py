"""A search over an expert family: each language's plan found on that language's own dev questions, held out per
language, and one shared plan that is best on average over the languages' dev sets.

    family = Family.parse("math/", ["sw=sw/", "te=te/"], base="base/")
    result = search_family(family, SearchConfig(langs=[], budget=20))
    result.languages["sw"].plan, result.languages["sw"].test      # each language's own search (`search.run.search`)
    result.shared.plan, result.shared.test["te"]                  # the plan best on average, held out per language

Each language is searched by the one search (`search.run.search`, with ``langs=[code]`` and that language's
expert): its own dev / test split (`search.split`: disjoint by construction), its held-out score with an exact
interval and its baselines. The shared plan is then chosen among the plans the searches evaluated: each language's
`shared_top` best (the same ranking as a search's choice: dev accuracy, a tie to fewer swapped layers) race on
every language's whole dev set, and the one with the highest mean dev accuracy over the languages wins (a tie to
fewer swapped layers, then to the first found). Only the winner is scored on each language's held-out questions
and compared (exact McNemar) with that language's own plan. Every answer is a record of the results file
(`search.store`, the keys the searches use), so a killed family search resumes and the answers the searches gave
are reused, never asked again; engines start only when a question must be answered.

Everything cheap is checked first: the family's shape and cap, a test set per code, every member's compatibility
(`serving.family.check_test_sets`, `models.family.check_family`), and each language's split; splits drawn from
the sets must agree, so that no problem (MGSM's languages are translations of one set) is a dev question in one
language and held out in another.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from layerswap.core.errors import UserError
from layerswap.core.runtime import Progress, no_progress
from layerswap.engines import EngineSettings
from layerswap.models.family import MAX_LANGS, Family
from layerswap.models.presets import portable_ref
from layerswap.recipe.plans import Plan
from layerswap.recipe.recipes import Recipe
from layerswap.search.report import SearchResult, Trial, accuracy, compare
from layerswap.search.run import SearchConfig, default_results, for_models, search
from layerswap.search.split import split_questions
from layerswap.search.store import Answers, Identity, Tally, identities, model_of, scorer
from layerswap.sweeps.log import ResultsLog

SHARED_TOP = 3  # each language's best plans that race for the shared plan
MAX_SHARED_TOP = 20


def layers(plan: Plan) -> int:
    return plan.b + plan.u + plan.tb + plan.tu


def rank(t: Trial) -> tuple[float, int]:
    """A search's choice rule (`search.run`): the highest dev accuracy, a tie to the plan swapping fewer layers."""
    return t.race.accuracy, -layers(t.plan)


def plan_key(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), sort_keys=True)


@dataclass
class Candidate:
    """A plan racing for the shared plan: the languages whose best it was, its dev accuracy per language."""

    plan: Plan
    found_in: list[str]
    dev: dict[str, dict] = field(default_factory=dict)  # code -> {"n", "correct", "accuracy"}

    @property
    def mean_dev(self) -> float:
        return sum(d["accuracy"] for d in self.dev.values()) / len(self.dev)

    def to_dict(self) -> dict:
        return {"plan": self.plan.title(), "params": self.plan.to_dict(), "found_in": list(self.found_in),
                "dev": self.dev, "mean_dev": round(self.mean_dev, 4) if self.dev else None}


@dataclass
class SharedPlan:
    """The plan best on average over the languages' dev sets, and its held-out score per language."""

    plan: Plan | None
    candidates: list[Candidate]
    top: int = SHARED_TOP  # each language's best plans that raced
    test: dict[str, dict] = field(default_factory=dict)  # code -> `report.accuracy` (exact interval)
    vs_own: dict[str, dict] = field(default_factory=dict)  # code -> `report.compare` against that language's plan

    def to_dict(self) -> dict:
        best = next((c for c in self.candidates if self.plan is not None and c.plan == self.plan), None)
        return {"plan": None if self.plan is None else {**self.plan.to_dict(), "title": self.plan.title()},
                "chosen_by": f"the highest mean dev accuracy over the languages among each language's {self.top} "
                             "best plans (a tie to fewer swapped layers)",
                "mean_dev": None if best is None else round(best.mean_dev, 4),
                "candidates": [c.to_dict() for c in self.candidates], "test": self.test, "vs_own_plan": self.vs_own}


@dataclass
class FamilySearchResult:
    family: Family
    languages: dict[str, SearchResult]  # code -> that language's own search
    shared: SharedPlan | None  # None when stopped before it was chosen
    seconds: float = 0.0
    results_file: str | None = None
    cancelled: bool = False

    def held_out(self) -> dict[str, dict]:
        """Per language: its own plan and the shared plan on its held-out questions (n, accuracy, exact interval)."""
        out = {}
        for code, r in self.languages.items():
            row = {"plan": None if r.plan is None else r.plan.title(), "test": r.test,
                   "shared_plan": None if self.shared is None or self.shared.plan is None
                   else self.shared.plan.title(),
                   "shared_test": None if self.shared is None else self.shared.test.get(code)}
            out[code] = row
        return out

    def to_dict(self) -> dict:
        fam = self.family
        return {"family": {"math": portable_ref(fam.math), "base": fam.base and portable_ref(fam.base),
                           "languages": {m.code: portable_ref(m.ref) for m in fam.members}},
                "held_out": self.held_out(), "shared": None if self.shared is None else self.shared.to_dict(),
                "languages": {code: r.to_dict() for code, r in self.languages.items()},
                "seconds": round(self.seconds, 2), "results_file": self.results_file, "stopped": self.cancelled}

    def markdown(self) -> str:
        lines = [("**Stopped.** " if self.cancelled else "") + f"**A family of {len(self.family.members)}:** each "
                 "language's plan chosen on its own dev questions, held out on questions never seen (exact 95% "
                 f"interval); {self.seconds:.0f} s"]
        for code, r in self.languages.items():
            if r.plan is None:
                lines.append(f"- {code}: no plan scored on every dev question yet")
                continue
            lines.append(f"- {code}: **{r.plan.title()}**: dev {100 * r.dev['accuracy']:.1f} % (optimistic); "
                         + (f"held-out {_pct(r.test)}" if r.test else "held-out not evaluated (stopped)"))
        s = self.shared
        if s is None or s.plan is None:
            lines.append("- shared plan: not chosen (stopped); run the search again to go on")
            return "\n".join(lines)
        best = next(c for c in s.candidates if c.plan == s.plan)
        lines.append(f"- shared plan: **{s.plan.title()}**: mean dev {100 * best.mean_dev:.1f} % over "
                     f"{len(best.dev)} languages (the best of {len(s.candidates)} candidates)")
        for code, t in s.test.items():
            v = s.vs_own.get(code)
            lines.append(f"  - {code}: held-out {_pct(t)}" + (
                f"; vs its own plan {100 * v['difference']:+.1f} points, McNemar p = {v['mcnemar']['p']:.2g}"
                if v else ""))
        return "\n".join(lines)

    def text(self) -> str:
        return self.markdown().replace("**", "")


def _pct(t: dict) -> str:
    return (f"{100 * t['accuracy']:.1f} % [{100 * t['interval'][0]:.1f}, {100 * t['interval'][1]:.1f}] "
            f"on {t['n']} answers")


def language_configs(family: Family, config: SearchConfig) -> dict[str, SearchConfig]:
    """Each language's search configuration: ``langs=[code]`` and what its models bring (`for_models`)."""
    return {m.code: for_models(replace(config, langs=[m.code]), family.math, m.ref, family.base)
            for m in family.members}


def check(family: Family, configs: dict[str, SearchConfig], *, cap: int = MAX_LANGS, force: bool = False,
          shared_top: int = SHARED_TOP) -> None:
    """Everything cheap, before any search: shape and cap, each code's test set, every member's compatibility
    (`models.family.check_family`, with the workbench's adapter rule), each configuration and split."""
    from layerswap.merge.merging import adapter_pair
    from layerswap.models.family import check_family
    from layerswap.serving.family import check_test_sets

    if not isinstance(shared_top, int) or not 1 <= shared_top <= MAX_SHARED_TOP:
        raise UserError(f"shared_top is a number of plans per language from 1 to {MAX_SHARED_TOP}, not "
                        f"{shared_top!r}.")
    family.validate(cap)
    for m in family.members:
        check_test_sets(Family(family.math, (m,), family.base), configs[m.code].source)
    check_family(family, force=force, pair_check=adapter_pair)
    drawn = {}
    for code, cfg in configs.items():
        cfg.validate()
        try:
            split = split_questions(cfg.langs, cfg.source, cfg.seed, cfg.dev, cfg.test, cfg.dev_source)
        except UserError as e:
            raise UserError(f"--lang {code}=: {e}") from None
        if split.dev_source is None:
            drawn[code] = split
    # MGSM's languages are translations of one set: a problem the shared plan is chosen on (any language's dev)
    # must be held out in none
    dev = {i for sp in drawn.values() for i in sp.dev}
    if any(dev & set(sp.test) for sp in drawn.values()):
        sizes = ", ".join(f"{c}: {sp.total}" for c, sp in drawn.items())
        raise UserError(f"The languages' sets split differently ({sizes} questions): a family search needs parallel "
                        "sets (question i the same problem in each language), so that no problem is a dev question "
                        "in one language and held out in another; give sets of one size (--mgsm-dir).")


def search_family(family: Family, config: SearchConfig, *, results: str | Path | None = None,
                  engine: EngineSettings | None = None, force: bool = False, progress: Progress | None = None,
                  cancel: threading.Event | None = None, shared_top: int = SHARED_TOP, cap: int = MAX_LANGS,
                  workers: int = 0, address: str | None = None, checked: bool = False) -> FamilySearchResult:
    """Search each language's plan, then the shared plan (see the module's docstring). `config.langs` is ignored:
    each language is its member's code. `cancel` stops after the current chunk, keeping what was answered.
    `checked`: the caller made `check` already."""
    t0 = time.perf_counter()
    p = progress or no_progress
    configs = language_configs(family, config)
    if not checked:
        check(family, configs, cap=cap, force=force, shared_top=shared_top)
    path = Path(results) if results is not None else default_results()
    steps = len(family.codes) + 1
    found: dict[str, SearchResult] = {}
    for k, m in enumerate(family.members):
        def part(f: float, text: str, k=k, code=m.code) -> None:
            p((k + f) / steps, f"{code} ({k + 1}/{len(family.codes)}): {text}")

        found[m.code] = search(family.math, m.ref, family.base, configs[m.code], results=path, engine=engine,
                               force=force, progress=part, cancel=cancel, workers=workers, address=address)
        if found[m.code].cancelled:
            return FamilySearchResult(family, found, None, time.perf_counter() - t0, str(path), True)
    shared, cancelled = _shared(family, configs, found, path, engine or EngineSettings(), force, shared_top,
                                cancel, lambda f, text: p((steps - 1 + f) / steps, f"shared plan: {text}"))
    p(1.0, "stopped" if cancelled else "done")
    return FamilySearchResult(family, found, shared, time.perf_counter() - t0, str(path), cancelled)


def candidates(found: dict[str, SearchResult], top: int) -> list[Candidate]:
    """Each language's `top` best complete plans (its search's ranking), each plan once, in the order found."""
    out: dict[str, Candidate] = {}
    for code, r in found.items():
        best = sorted((t for t in r.trials if t.race.complete), key=rank, reverse=True)[:top]
        for t in best:
            out.setdefault(plan_key(t.plan), Candidate(t.plan, [])).found_in.append(code)
    return list(out.values())


class _Language:
    """One language's workbench (headers only until a question must be answered) and the searches' keys."""

    def __init__(self, family: Family, code: str, cfg: SearchConfig, settings: EngineSettings, force: bool):
        from layerswap.serving.workbench import Workbench

        self.cfg = cfg
        self.wb = Workbench.from_settings(settings)
        try:
            self.wb.check(family.math, family.member(code).ref, family.base, force=force)
        except BaseException:
            self.wb.close()
            raise
        # the keys `search.run.search` gives its records, so its answers are found, never asked again
        self.test, self.dev = identities(self.wb, cfg, force)

    def answers(self, ident: Identity, plan: Plan, ids, answers: Answers, log, tally: Tally, cancel, name: str,
                progress) -> list[bool] | None:
        """Whether `plan` answers each question of `ids` right (recorded answers first), or None when cancelled."""
        who = Recipe(plan=plan)
        known = answers.known.setdefault(ident.model_key(model_of(who)), {})
        got = scorer(self.wb, ident, who, known, tally, log.append, cancel, name=name, progress=progress)(list(ids))
        return None if got is None else [x == 1.0 for x in got]

    def close(self) -> None:
        self.wb.close()


def _shared(family: Family, configs: dict[str, SearchConfig], found: dict[str, SearchResult], path: Path,
            settings: EngineSettings, force: bool, top: int, cancel, p: Progress) -> tuple[SharedPlan, bool]:
    """The candidates on every language's whole dev set, the best on average, and its held-out per language."""
    cands = candidates(found, top)
    shared = SharedPlan(None, cands, top)
    if not cands:
        return shared, False
    tally = Tally()
    n = len(family.codes)
    with ResultsLog(path) as log:
        answers = Answers.from_rows(log.rows.values())
        for k, code in enumerate(family.codes):  # dev: every candidate on this language's dev questions
            lang = _Language(family, code, configs[code], settings, force)
            try:
                for j, c in enumerate(cands):
                    def tick(f: float, d: str = "", k=k, j=j, code=code) -> None:
                        p(0.8 * (k + (j + min(max(f, 0.0), 1.0)) / len(cands)) / n,
                          f"candidate {j + 1}/{len(cands)} on {code} dev")
                    right = lang.answers(lang.dev, c.plan, found[code].split.dev, answers, log, tally, cancel,
                                         f"shared candidate {c.plan.title()}", tick)
                    if right is None:
                        return shared, True
                    c.dev[code] = {"n": len(right), "correct": sum(right),
                                   "accuracy": round(sum(right) / len(right), 4)}
            finally:
                lang.close()
        best = max(cands, key=lambda c: (c.mean_dev, -layers(c.plan)))  # max keeps the first of equals
        shared.plan = best.plan
        for k, code in enumerate(family.codes):  # held out: only the chosen plan, and the language's own to compare
            lang = _Language(family, code, configs[code], settings, force)
            try:
                ids = found[code].split.test
                tick = lambda f, d="", k=k, code=code: p(0.8 + 0.2 * (k + min(max(f, 0.0), 1.0)) / n,  # noqa: E731
                                                         f"held-out questions of {code}")
                got = lang.answers(lang.test, best.plan, ids, answers, log, tally, cancel, "shared plan", tick)
                own = None if found[code].plan is None else lang.answers(
                    lang.test, found[code].plan, ids, answers, log, tally, cancel, "plan", tick)
                if got is None or (found[code].plan is not None and own is None):
                    return shared, True
                shared.test[code] = accuracy({code: got})
                if own is not None:
                    shared.vs_own[code] = compare("its own plan", {code: got}, {code: own})
            finally:
                lang.close()
    return shared, False


__all__ = ["SHARED_TOP", "Candidate", "FamilySearchResult", "SharedPlan", "candidates", "check", "language_configs",
           "search_family"]
