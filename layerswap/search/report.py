"""What a search found, said honestly: the plan chosen on dev, its score on held-out questions with an exact
interval, paired comparisons (exact McNemar) with the math expert, the language expert and the default plan,
how many plans and questions the search looked at, and the split.

The dev score is the best of many plans on the same questions, so it is optimistic; the test score is
not (those questions were never seen by the search). With one language the test interval is exact
(Clopper-Pearson); with several it is computed over the pooled answers (translations of one problem are
not independent, so it is somewhat narrow) and each language's exact interval is given too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layerswap.recipe.plans import Plan
from layerswap.core.stats import clopper_pearson, mcnemar, paired_difference
from layerswap.search.prior import Prior
from layerswap.search.race import Race
from layerswap.search.space import Space
from layerswap.search.split import Split


@dataclass
class Trial:
    """One plan the search evaluated: its prior's name (if it was one), the plan and how far it got."""

    name: str
    plan: Plan
    race: Race

    def to_dict(self) -> dict:
        return {"plan": self.plan.title(), "params": self.plan.to_dict(), "prior": self.name or None,
                "questions": len(self.race.scores), "dev_accuracy": round(self.race.accuracy, 4),
                "complete": self.race.complete}


def accuracy(per_lang: dict[str, list[bool]]) -> dict:
    """n (answers), accuracy and its 95 % interval, overall and per language."""
    pooled = [x for xs in per_lang.values() for x in xs]
    k, n = sum(pooled), len(pooled)
    out = {"n": n, "questions": len(next(iter(per_lang.values()))), "accuracy": round(k / n, 4),
           "interval": [round(x, 4) for x in clopper_pearson(k, n)],
           "interval_kind": "exact (Clopper-Pearson)" if len(per_lang) == 1 else "Clopper-Pearson over pooled answers"}
    if len(per_lang) > 1:
        out["per_lang"] = {lang: {"n": len(xs), "accuracy": round(sum(xs) / len(xs), 4),
                                  "interval": [round(x, 4) for x in clopper_pearson(sum(xs), len(xs))]}
                           for lang, xs in per_lang.items()}
    return out


def compare(name: str, plan: dict[str, list[bool]], other: dict[str, list[bool]]) -> dict:
    """The plan against another model on the same test answers: paired difference ± SE and exact McNemar."""
    a = [x for xs in plan.values() for x in xs]
    b = [x for xs in other.values() for x in xs]
    d, m = paired_difference(a, b), mcnemar(a, b)
    return {"name": name, "test": accuracy(other), "difference": round(d.diff, 4), "se": round(d.se, 4),
            "mcnemar": {"only_plan": m.only_a, "only_other": m.only_b, "p": m.p}}


@dataclass
class SearchResult:
    plan: Plan | None  # None when stopped before any plan was scored on every dev question
    dev: dict
    test: dict | None  # None when stopped before the held-out evaluation
    baselines: list[dict]
    evaluated: dict
    split: Split
    strategy: str
    space: Space
    priors: list[Prior]
    trials: list[Trial] = field(default_factory=list)
    seconds: float = 0.0
    results_file: str | None = None
    cancelled: bool = False
    source: str | None = None

    def to_dict(self) -> dict:
        plan = None if self.plan is None else {**self.plan.to_dict(), "title": self.plan.title()}
        return {"plan": plan, "dev": self.dev, "test": self.test, "baselines": self.baselines,
                "evaluated": self.evaluated, "split": {**self.split.to_dict(), "source": self.source},
                "strategy": self.strategy, "space": self.space.to_dict(),
                "priors": [{"name": p.name, "plan": p.plan.title()} for p in self.priors],
                "trials": [t.to_dict() for t in self.trials], "seconds": round(self.seconds, 2),
                "results_file": self.results_file, "stopped": self.cancelled}

    def markdown(self) -> str:
        ev, dev = self.evaluated, self.dev
        head = "**Stopped.** " if self.cancelled else ""
        if self.plan is None:
            return head + ("No plan was scored on every dev question yet; run the search again to go on. Dev "
                           f"questions: {self.split.chosen_on}.")
        lines = [f"{head}**Found: {self.plan.title()}** ({self.strategy}; {ev['plans']} plans and "
                 f"{ev['questions']:,} question-evaluations on dev, {ev['questions_run']:,} of them answered now, "
                 f"{ev['invalid']} plans that do not fit or are an expert unchanged, never evaluated; {self.seconds:.0f} s)",
                 f"- chosen on: {self.split.chosen_on}; the highest dev accuracy, a tie to the plan swapping fewer "
                 "layers",
                 f"- dev: {100 * dev['accuracy']:.1f} % on {dev['n']} answers: **optimistic**, the best of "
                 f"{ev['plans']} plans on these questions"]
        if self.test is None:
            lines.append("- held-out test: not evaluated (stopped); run again to score it")
            return "\n".join(lines)
        t = self.test
        lines.append(f"- held-out test: **{100 * t['accuracy']:.1f} %** [{100 * t['interval'][0]:.1f}, "
                     f"{100 * t['interval'][1]:.1f}] on {t['n']} answers never used in the search "
                     f"({t['interval_kind']})")
        for b in self.baselines:
            m, other = b["mcnemar"], b["name"].split(" (")[0]  # "the recommended plan (swap …)": its short name
            lines.append(f"- vs {b['name']}: {100 * b['test']['accuracy']:.1f} %; difference "
                         f"{100 * b['difference']:+.1f} ± {100 * b['se']:.1f} points, McNemar p = {m['p']:.2g} "
                         f"({m['only_plan']} right only with the plan, {m['only_other']} only with {other})")
        return "\n".join(lines)

    def text(self) -> str:
        return self.markdown().replace("**", "")
