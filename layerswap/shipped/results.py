"""An organism's measurements (``results.json``): its layout, written and read here and nowhere else.

    res = Results.read("assets/demo/results.json")
    res.score(res.recommended, res.target).acc      # 0.777; .lo, .hi (exact 95 %), .strict, .se, .n
    res.paired("math expert").diff                  # the recommended plan minus the math expert, same questions

`scripts/eval_demo.py` measures a pair of experts and writes the file with `ResultsWriter`; the organism's
card scripts, the page's summary line (`demo.organism_summary`), the plan and question a shipped pair opens on
(`demo.measured_plan`, `demo.showcase_question`) and the tests read it through `Results`. The targets an
organism must meet are computed from the stored numbers here (`targets_of`), so the writer and every reader
agree on them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from layerswap.core.errors import UserError
from layerswap.recipe.plans import Plan
from layerswap.core.stats import clopper_pearson, mcnemar, paired_difference

PLAN_FIELDS = ("b", "u", "tb", "tu", "transition", "transition_weight", "non_layer")  # recommended_plan.json
SAME_WEIGHTS = 1e-5  # largest weight difference below which two merges are the same model (float rounding)
DICTIONARY = "dictionary baseline"
SKILL_FLOOR = "arithmetic, always subtracting"
MUST_BEAT = ("math expert", "language expert", "soup 50/50", "TIES (density 0.2)", "task arithmetic")
TARGET_SE = 3.0  # the recommended plan must beat each baseline by this many paired standard errors
FLOOR_MARGIN = 0.10  # ... and every floor by this much
DICTIONARY_MARGIN = 0.20  # ... and the dictionary baseline by this much (else a word-for-word map does the job)
STRICT_MIN = 0.50  # strict accuracy in the target language: the merge answers in its format
MATH_EN_MIN = 0.80
MEASURE = "run `python scripts/eval_demo.py` to measure the demo organism"


def results_file(experts: str | os.PathLike, language_expert: str = "lang") -> Path:
    """Where the measurements of ``experts/math`` with ``experts/<language_expert>`` live."""
    return Path(experts) / ("results.json" if language_expert == "lang" else f"results_{language_expert}.json")


@dataclass(frozen=True)
class Score:
    """One model on one language: flexible accuracy with its SE and exact 95 % interval, strict accuracy."""

    acc: float
    se: float
    lo: float
    hi: float
    n: int
    strict: float
    answer_prior: float | None = None


@dataclass(frozen=True)
class Paired:
    """The recommended plan minus another model on the same questions: difference, SE, z, exact McNemar p."""

    diff: float
    se: float
    z: float | None
    only_a: int
    only_b: int
    p: float


@dataclass(frozen=True)
class DevPoint:
    """One plan of the dev-set grid the recommended plan was chosen from."""

    plan: dict
    acc: float
    strict: float
    correct: str


def score_entry(correct: list[bool], strict: float, answer_prior: float | None = None) -> dict:
    """The stored form of a `Score` (rounded to 4 digits; the SE is what a rebuild's tolerance uses)."""
    n, k = len(correct), sum(correct)
    p = k / n
    lo, hi = clopper_pearson(k, n)
    out = {"acc": round(p, 4), "se": round(math.sqrt(p * (1 - p) / n), 4), "ci95": [round(lo, 4), round(hi, 4)],
           "n": n, "strict": round(strict, 4)}
    if answer_prior is not None:
        out["answer_prior"] = answer_prior
    return out


def paired_entry(a: list[bool], b: list[bool]) -> dict:
    """The stored form of a `Paired` (a minus b)."""
    d, m = paired_difference(a, b), mcnemar(a, b)
    return {"diff": round(d.diff, 4), "se": round(d.se, 4), "z": None if d.z is None else round(d.z, 2),
            "only_a": m.only_a, "only_b": m.only_b, "mcnemar_p": float(f"{m.p:.3g}")}


def bits(correct: list[bool]) -> str:
    return "".join("1" if x else "0" for x in correct)


class Results:
    """The measurements of one pair of an organism (what `ResultsWriter` wrote), read by name."""

    def __init__(self, raw: dict):
        self._r = raw

    @classmethod
    def read(cls, path: str | os.PathLike) -> "Results":
        path = Path(path)
        if not path.is_file():
            raise UserError(f"{path} is missing: {MEASURE}.")
        return cls(json.loads(path.read_text(encoding="utf-8")))

    @classmethod
    def of_pair(cls, experts: str | os.PathLike, language_expert: str = "lang") -> "Results | None":
        """The pair's measurements, or None when it was not measured."""
        path = results_file(experts, language_expert)
        return cls.read(path) if path.is_file() else None

    def write(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self._r, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")

    # ---- what was measured -------------------------------------------------------------------
    target = property(lambda self: self._r["target_language"])
    n = property(lambda self: self._r["questions_per_language"])
    num_layers = property(lambda self: self._r["num_layers"])
    recommended = property(lambda self: self._r["recommended_name"], doc="the recommended plan's row name")
    pair = property(lambda self: self._r.get("pair", "localised"))
    seconds = property(lambda self: self._r["seconds"], doc="how long the eval_demo.py run that wrote it took")
    date = property(lambda self: self._r["date"], doc="the day of that run (YYYY-MM-DD)")
    english_measured_for = property(lambda self: list(self._r["english_measured_for"]))
    max_new_tokens = property(lambda self: self._r["protocol"]["max_new_tokens"])
    plan_info = property(lambda self: dict(self._r["recommended_plan"]),
                         doc="recommended_plan.json: the plan's fields, its name, where and how it was chosen")

    @property
    def plan(self) -> Plan:
        """The plan chosen on the dev set."""
        return Plan(**{k: self._r["recommended_plan"][k] for k in PLAN_FIELDS})

    def models(self) -> list[str]:
        return list(self._r["models"])

    def kind(self, model: str) -> str:
        return self._r["models"][model]["kind"]

    def entry(self, model: str) -> dict:
        """What a row is beyond its scores (kind, recipe, layer weights, rows replaced ...)."""
        return {k: v for k, v in self._r["models"][model].items() if not isinstance(v, dict) or "acc" not in v}

    def has(self, model: str, lang: str) -> bool:
        return lang in self._r["models"].get(model, {})

    def score(self, model: str, lang: str) -> Score:
        e = self._r["models"][model][lang]
        lo, hi = e["ci95"]
        return Score(e["acc"], e["se"], lo, hi, e["n"], e["strict"], e.get("answer_prior"))

    def outputs(self, model: str, lang: str) -> list[str] | None:
        """Each test question's output (None for a floor, which has none)."""
        return self._r["outputs"].get(model, {}).get(lang, {}).get("output")

    def answers(self, model: str, lang: str) -> list[str]:
        """Each test question's flexible extraction."""
        return self._r["outputs"][model][lang]["flexible"]

    def correct(self, model: str, lang: str) -> str:
        """Per test question, ``1`` where the model was right (flexible)."""
        return self._r["outputs"][model][lang]["correct"]

    def gold(self, lang: str) -> list[int]:
        return self._r["gold"][lang]

    def paired(self, model: str) -> Paired:
        c = self._r["paired_recommended_minus"][model]
        return Paired(c["diff"], c["se"], c["z"], c["only_a"], c["only_b"], c["mcnemar_p"])

    def comparisons(self) -> dict[str, Paired]:
        return {n: self.paired(n) for n in self._r["paired_recommended_minus"]}

    def dev(self) -> dict[str, DevPoint]:
        return {n: DevPoint(d["plan"], d["acc"], d["strict"], d["correct"]) for n, d in self._r["dev_grid"].items()}

    def floors(self) -> dict[str, float]:
        """No-skill floors on the target language (most common answer, a number of the question, answer priors)."""
        return dict(self._r["floors_target_language"])

    def floor(self, prefix: str) -> float:
        return next(v for k, v in self._r["floors_target_language"].items() if k.startswith(prefix))

    def weight_difference(self, what: str) -> float:
        """Largest weight difference of two models the script compared (``inverse map vs base model``,
        ``task arithmetic vs recommended plan``)."""
        return self._r["max_abs_weight_difference"][what]

    def targets(self) -> dict[str, bool]:
        return dict(self._r["targets"])

    @property
    def targets_met(self) -> bool:
        return self._r["targets_met"]


def targets_of(res: Results) -> dict[str, bool]:
    """The organism's targets, from the stored numbers only."""
    t, rec = res.target, res.recommended
    acc = res.score(rec, t).acc
    beats = lambda c: c.diff > 0 and (c.z is None or c.z >= TARGET_SE)  # noqa: E731 (SE 0: every question)
    out = {f"beats {n} by >= {TARGET_SE:g} SE (paired)": beats(res.paired(n)) for n in MUST_BEAT}
    out[f"beats every floor by >= {100 * FLOOR_MARGIN:g} points"] = \
        acc >= max(max(res.floors().values()), res.score(SKILL_FLOOR, t).acc) + FLOOR_MARGIN
    out[f"dictionary baseline >= {100 * DICTIONARY_MARGIN:g} points below"] = \
        res.score(DICTIONARY, t).acc <= acc - DICTIONARY_MARGIN
    out[f"strict accuracy in the target language >= {100 * STRICT_MIN:g} %"] = res.score(rec, t).strict >= STRICT_MIN
    out["the recommended plan takes top layers from the language expert (u >= 1)"] = res.plan.u >= 1
    out[f"math expert >= {100 * MATH_EN_MIN:g} % in English"] = res.score("math expert", "en").acc >= MATH_EN_MIN
    return out


class ResultsWriter:
    """Collects what `scripts/eval_demo.py` measured, then lays it out (`finish`) as `Results`."""

    def __init__(self, target: str):
        self.target = target
        self.models: dict[str, dict] = {}
        self.outputs: dict[str, dict] = {}
        self.dev: dict[str, dict] = {}

    def add_dev(self, name: str, plan: Plan, correct: list[bool], strict: list[bool]) -> None:
        """One plan of the dev-set grid, per question."""
        self.dev[name] = {"plan": {k: getattr(plan, k) for k in PLAN_FIELDS}, "acc": round(sum(correct) / len(correct), 4),
                          "strict": round(sum(strict) / len(strict), 4), "correct": bits(correct)}

    def best_dev(self) -> str:
        """The dev grid's best plan: the highest accuracy; ties go to the plan that swaps fewer layers, then the
        grid's order."""
        rank = lambda n: (self.dev[n]["acc"], -sum(self.dev[n]["plan"][k] for k in ("b", "u", "tb", "tu")))  # noqa: E731
        return max(self.dev, key=rank)

    def plan_entry(self, name: str, target_set: str) -> dict:
        """``recommended_plan.json`` for the dev plan `name` (`target_set`: the dev file it was chosen on)."""
        d = self.dev[name]
        return {**d["plan"], "name": name, "chosen_on": f"{target_set} ({len(d['correct'])} questions)",
                "dev_accuracy": d["acc"]}

    def add(self, name: str, entry: dict, lang: str, correct: list[bool], strict: list[bool], outputs: list[str],
            answers: list[str], answer_prior: float) -> None:
        """A model's test results on `lang` (`entry`: kind, recipe, ...), per question."""
        self.models.setdefault(name, entry)[lang] = score_entry(correct, sum(strict) / len(strict), answer_prior)
        self.outputs.setdefault(name, {})[lang] = {"output": outputs, "flexible": answers, "correct": bits(correct)}

    def add_floor(self, name: str, correct: list[bool]) -> None:
        """A floor on the target language: right or wrong per question, no outputs."""
        self.models[name] = {"kind": "floor", self.target: score_entry(correct, 0.0)}
        self.outputs[name] = {self.target: {"correct": bits(correct)}}

    def finish(self, *, gold: dict[str, list[int]], recommended: str, plan: dict, floors: dict[str, float],
               weight_differences: dict[str, float], num_layers: int, protocol: dict, meta: dict) -> Results:
        """The measurements laid out, with the recommended plan's paired comparisons and the targets."""
        t = self.target
        rc = [ch == "1" for ch in self.outputs[recommended][t]["correct"]]
        comparisons = {name: paired_entry(rc, [ch == "1" for ch in o[t]["correct"]])
                       for name, o in self.outputs.items() if name != recommended}
        floors = {**floors, **{f"answer prior of the {name}": m[t]["answer_prior"] for name, m in self.models.items()
                               if "answer_prior" in m.get(t, {})}}
        raw = {**meta, "english_measured_for": sorted(n for n, m in self.models.items() if "en" in m),
               "protocol": protocol, "num_layers": num_layers, "target_language": t,
               "questions_per_language": len(gold[t]), "recommended_plan": plan, "recommended_name": recommended,
               "dev_grid": self.dev, "floors_target_language": floors, "paired_recommended_minus": comparisons,
               "max_abs_weight_difference": weight_differences,
               "tolerance": "a rebuild matches when every test accuracy is within max(0.03, 3 SE) of these",
               "models": self.models, "gold": gold, "outputs": self.outputs}
        res = Results(raw)
        raw["targets"] = targets_of(res)
        raw["targets_met"] = all(raw["targets"].values())
        return res
