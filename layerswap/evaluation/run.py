"""MGSM evaluation: every question of the chosen languages, answered by engines and scored like lm-evaluation-harness.

    from layerswap.evaluation.run import EvalConfig, evaluate
    from layerswap.engines import open_engine
    engine, note = open_engine("merged/")                    # vLLM when installed, else transformers
    report = evaluate({"merged": engine}, EvalConfig(langs=["sw", "te"], source="mgsm/"))
    print(report.table_text()); report.write_jsonl("results.jsonl")

The default protocol is lm-eval's ``mgsm_native_cot_XX``: native question/answer words, 0-shot
(8-shot from ``exemplars.json`` on request, exemplars sampled with one ``random.Random(1234)``
per language as lm-eval does), greedy, stop at the native question word, ``</s>`` and
``<|im_end|>``, 256 new tokens, strict and flexible extraction, exact match after lower-casing
and removing punctuation. ``mode="direct"`` gives ``mgsm_direct_XX``. Prompts, extraction and
scoring are `layerswap.evaluation.mgsm`'s.

Several models are evaluated on the same prompts one after the other. Each engine batches a
language's prompts itself (`layerswap.engines.base`); `evaluate` reports progress after every
batch the engine finishes and stops cleanly (keeping what is done) when `cancel` is set.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from layerswap.evaluation import mgsm
from layerswap.engines import Engine
from layerswap.core.errors import UserError
from layerswap.core.runtime import Progress, no_progress

METRICS = mgsm.TASK.metric_names


@dataclass
class EvalConfig:
    langs: list[str] = field(default_factory=lambda: list(mgsm.PAPER_LANGS))
    limit: int | None = None  # first N questions per language (None: all 250)
    ids: tuple[int, ...] | None = None  # these questions of every language instead (MGSM's are parallel)
    shots: int = mgsm.TASK.shots  # 0 (lm-eval's default) up to `TASK.max_shots` exemplars from exemplars.json
    mode: str = mgsm.TASK.mode  # one of `TASK.modes`
    max_new_tokens: int = mgsm.MAX_NEW_TOKENS
    source: str | None = None  # MGSM folder; None: $LAYERSWAP_MGSM_DIR, else the Hub

    def validate(self) -> None:
        if not self.langs:
            raise UserError("Choose at least one MGSM language.")
        mgsm.TASK.check_mode(self.mode)
        mgsm.TASK.check_shots(self.shots)
        if self.limit is not None and self.limit < 1:
            raise UserError(f"limit must be at least 1 question per language, not {self.limit}.")
        if self.max_new_tokens < 1:
            raise UserError("max_new_tokens must be at least 1.")
        if self.ids is not None and (not self.ids or self.limit is not None):
            raise UserError("Give either a limit or a non-empty list of question ids, not both.")
        langs = mgsm.languages(self.source if self.source is not None else mgsm.default_data_dir())
        unknown = [c for c in self.langs if c not in langs]
        if unknown:
            raise UserError(f"Unknown MGSM language code{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                            f"choose from: {', '.join(sorted(langs))}.")


@dataclass
class QuestionResult:
    model: str
    lang: str
    index: int
    question: str
    prompt: str
    output: str
    gold: int
    strict: str
    flexible: str
    strict_correct: bool
    flexible_correct: bool
    engine: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class EvalReport:
    config: EvalConfig
    models: list[str]
    results: list[QuestionResult] = field(default_factory=list)
    engines: dict[str, str] = field(default_factory=dict)  # model -> engine name that answered
    seconds: dict[str, float] = field(default_factory=dict)
    cancelled: bool = False

    def accuracy(self, model: str, lang: str, metric: str = "flexible") -> float | None:
        rows = [r for r in self.results if r.model == model and r.lang == lang]
        if not rows:
            return None
        return sum(getattr(r, f"{metric}_correct") for r in rows) / len(rows)

    def counts(self, model: str, lang: str) -> int:
        return sum(1 for r in self.results if r.model == model and r.lang == lang)

    def table(self, metric: str = "flexible") -> list[dict]:
        """One row per language (accuracy in %, per model), then the average and the max over languages."""
        mgsm.TASK.check_metric(metric)
        rows = []
        for lang in self.config.langs:
            row: dict = {"language": lang, "n": max((self.counts(m, lang) for m in self.models), default=0)}
            for m in self.models:
                a = self.accuracy(m, lang, metric)
                row[m] = None if a is None else round(100 * a, 1)
            rows.append(row)
        n_total = sum(r["n"] for r in rows)
        for label, agg in (("average", lambda v: sum(v) / len(v)), ("max", max)):
            row = {"language": label, "n": n_total}
            for m in self.models:
                vals = [r[m] for r in rows if r[m] is not None]
                row[m] = round(agg(vals), 1) if vals else None
            rows.append(row)
        return rows

    def table_text(self, metric: str = "flexible") -> str:
        rows = self.table(metric)
        head = ["language", "n", *self.models]
        lines = [" | ".join(head), " | ".join("---" for _ in head)]
        for r in rows:
            lines.append(" | ".join("–" if r[h] is None else str(r[h]) for h in head))
        return "\n".join(lines)

    def write_jsonl(self, path: str | os.PathLike) -> Path:
        """One JSON object per question and model (prompt, output, extractions, gold, correctness)."""
        path = Path(path)
        if path.parent and not path.parent.exists():
            raise UserError(f"Cannot write {path}: folder {path.parent} does not exist.")
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in self.results:
                f.write(json.dumps({**r.to_dict(), "shots": self.config.shots, "mode": self.config.mode},
                                   ensure_ascii=False) + "\n")
        tmp.replace(path)
        return path


def build_prompts(lang_code: str, config: EvalConfig) -> list[mgsm.Prompt]:
    """The test prompts of one language as lm-eval builds them (`mgsm.prompts`): the first `limit` in file order,
    or the questions `ids` in that order (each with the exemplars lm-eval's shared sampler gives it)."""
    if config.ids is None:
        return mgsm.prompts(lang_code, limit=config.limit, shots=config.shots, mode=config.mode, source=config.source)
    every = mgsm.prompts(lang_code, limit=max(config.ids) + 1, shots=config.shots, mode=config.mode,
                         source=config.source)
    bad = [i for i in config.ids if not 0 <= i < len(every)]
    if bad:
        raise UserError(f"Question id {bad[0]} is outside {lang_code}'s set (0 to {len(every) - 1}).")
    return [every[i] for i in config.ids]


class Cancelled(Exception):
    """Raised from the per-batch callback to stop an evaluation between batches."""


def evaluate(engines: Mapping[str, Engine], config: EvalConfig, *, progress: Progress | None = None,
             cancel: threading.Event | None = None) -> EvalReport:
    """Evaluate each named model on the same prompts, one language at a time.

    Each engine gets all prompts of a language and batches them itself; `progress(fraction, text)`
    is called after every batch it finishes. When `cancel` is set the run stops after the current
    batch and the report (``cancelled=True``) holds the questions already answered.
    """
    config.validate()
    prompts = {c: build_prompts(c, config) for c in config.langs}  # all data errors before any generation
    langs = {c: ps[0].language for c, ps in prompts.items()}
    report = EvalReport(config, list(engines))
    total = len(engines) * sum(len(p) for p in prompts.values())
    done = 0
    p = progress or no_progress

    def counter(base: int, where: str, batch: list[mgsm.Prompt]) -> Callable[[dict[int, str]], None]:
        """Progress of one model on one language: questions answered, and accuracy so far (flexible)."""
        correct: dict[int, bool] = {}  # each answer scored once, as it arrives

        def tick(answered: dict[int, str]) -> None:
            for i in answered.keys() - correct.keys():
                correct[i] = batch[i].score(answered[i]).flexible_correct
            n = len(answered)
            right = sum(correct[i] for i in answered)
            p((base + n) / total, f"{where} {n}/{len(batch)} questions, {100 * right / max(n, 1):.0f}% right so far")
        return tick

    p(0.0, "starting")
    for model, engine in engines.items():
        report.engines[model] = getattr(engine, "name", type(engine).__name__)
        t = time.perf_counter()
        for code, batch in prompts.items():
            if cancel is not None and cancel.is_set():
                report.cancelled = True
                break
            answered, report.cancelled = _answer(engine, [x.prompt for x in batch], config.max_new_tokens,
                                                 langs[code].stop, cancel, counter(done, f"{model}: {code}", batch))
            for i in sorted(answered):
                x, out = batch[i], answered[i]
                s = x.score(out)
                report.results.append(QuestionResult(model, code, x.index, x.question, x.prompt, out,
                                                     x.gold, s.strict, s.flexible, s.strict_correct,
                                                     s.flexible_correct, report.engines[model]))
            done += len(batch)
            if report.cancelled:
                break
        report.seconds[model] = time.perf_counter() - t
        if report.cancelled:
            break
    p(1.0, "cancelled" if report.cancelled else "done")
    return report


def _answer(engine: Engine, prompts: list[str], max_new_tokens: int, stop: list[str],
            cancel: threading.Event | None,
            answered_so_far: Callable[[dict[int, str]], None]) -> tuple[dict[int, str], bool]:
    """The engine's answers by prompt index, and whether a cancel stopped it (finished batches are kept).

    The engine batches `prompts` itself; after each batch `answered_so_far(answers)` reports progress
    and a set `cancel` stops the engine by raising from its callback.
    """
    answered: dict[int, str] = {}

    def on_batch(indices: list[int], outputs: list[str]) -> None:
        answered.update(zip(indices, outputs))
        answered_so_far(answered)
        if cancel is not None and cancel.is_set():
            raise Cancelled

    try:
        outputs = engine.generate(prompts, max_new_tokens=max_new_tokens, stop=stop, on_batch=on_batch)
    except Cancelled:
        return answered, True
    return dict(enumerate(outputs)), False
