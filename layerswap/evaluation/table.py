"""The family table: per language and model, MGSM accuracy with its exact interval and a paired test against the
better of the two experts; an average column; as Markdown, CSV and JSON.

    table = family_table(report)        # an EvalReport whose models are the rows, its languages the columns
    print(table.markdown()); table.write("t.json", "json"); table.write("t.csv", "csv")

Pure: it reads per-question correctness from one `run.EvalReport` (`serving.family.evaluate_family` makes it: the
math expert, each language's own expert under one row, the swap and the baselines) and computes nothing else. Per
cell: n, correct, accuracy, the exact Clopper–Pearson 95 % interval (`core.stats.clopper_pearson`) and, for every
model but the better expert of that language, the exact two-sided McNemar p against it (`core.stats.mcnemar`, on
the questions both answered). The better expert is the one with more correct answers (a tie goes to the math
expert). The average column is the mean of the languages' accuracies (the paper's "avg"), over the languages where
a model has a result. Cells not evaluated yet are empty, so a table of partial results reads the same way.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

from layerswap.core.errors import UserError
from layerswap.core.roles import ROLE_NAMES
from layerswap.core.stats import clopper_pearson, mcnemar
from layerswap.evaluation.run import METRICS, EvalReport

MATH, LANG = ROLE_NAMES["math"], ROLE_NAMES["lang"]  # the two expert rows: "math expert", "language expert"
FORMATS = ("json", "csv", "md")


@dataclass(frozen=True)
class Cell:
    """One model on one language's test set."""

    n: int
    correct: int
    low: float  # the exact 95 % interval of the accuracy
    high: float
    p: float | None  # exact McNemar p against the better expert (None: this is the better expert)
    better: str  # the better expert of this language (MATH or LANG)

    @property
    def accuracy(self) -> float:
        return self.correct / self.n

    def to_dict(self) -> dict:
        return {"n": self.n, "correct": self.correct, "accuracy": self.accuracy, "interval": [self.low, self.high],
                "p_vs_better_expert": self.p, "better_expert": self.better}

    def text(self) -> str:
        return (f"{100 * self.accuracy:.1f} [{100 * self.low:.1f}, {100 * self.high:.1f}]"
                + ("" if self.p is None else f" p={self.p:.2g}"))


@dataclass(frozen=True)
class FamilyTable:
    languages: tuple[str, ...]
    models: tuple[str, ...]
    cells: dict[tuple[str, str], Cell]  # (model, language) -> cell; missing: not evaluated (yet)
    metric: str = "flexible"

    def cell(self, model: str, lang: str) -> Cell | None:
        return self.cells.get((model, lang))

    def average(self, model: str) -> float | None:
        """Mean accuracy over the languages evaluated for `model` (None when none is)."""
        accs = [c.accuracy for lang in self.languages if (c := self.cell(model, lang)) is not None]
        return sum(accs) / len(accs) if accs else None

    def markdown(self) -> str:
        """A row per model, a column per language ("accuracy [interval] p=…", in %), then the average."""
        head = ["model", *self.languages, "average"]
        lines = [" | ".join(head), " | ".join("---" for _ in head)]
        for m in self.models:
            avg = self.average(m)
            cells = [c.text() if (c := self.cell(m, lang)) is not None else "–" for lang in self.languages]
            lines.append(" | ".join([m, *cells, "–" if avg is None else f"{100 * avg:.1f}"]))
        return "\n".join(lines)

    def rows(self) -> list[dict]:
        """One flat row per model and language (and per model for the average), as the CSV holds them."""
        out = []
        for m in self.models:
            for lang in self.languages:
                c = self.cell(m, lang)
                out.append({"model": m, "language": lang, **({} if c is None else {
                    "n": c.n, "correct": c.correct, "accuracy": round(c.accuracy, 6), "low": round(c.low, 6),
                    "high": round(c.high, 6), "p_vs_better_expert": "" if c.p is None else f"{c.p:.6g}",
                    "better_expert": c.better})})
            avg = self.average(m)
            out.append({"model": m, "language": "average", "accuracy": "" if avg is None else round(avg, 6)})
        return out

    def csv(self) -> str:
        cols = ["model", "language", "n", "correct", "accuracy", "low", "high", "p_vs_better_expert", "better_expert"]
        buf = io.StringIO()
        w = csv.DictWriter(buf, cols, restval="", lineterminator="\n")
        w.writeheader()
        w.writerows(self.rows())
        return buf.getvalue()

    def to_dict(self) -> dict:
        """Per language and model: n, correct, accuracy, interval, p vs the better expert; the average per model."""
        return {"metric": self.metric, "languages": list(self.languages), "models": list(self.models),
                "results": {lang: {m: c.to_dict() for m in self.models if (c := self.cell(m, lang)) is not None}
                            for lang in self.languages},
                "average": {m: self.average(m) for m in self.models}}

    def text(self, fmt: str, extra: dict | None = None) -> str:
        """The table as json (with `extra` keys beside it), csv or md."""
        if fmt not in FORMATS:
            raise UserError(f"Unknown table format {fmt!r}; use one of {', '.join(FORMATS)}.")
        if fmt == "json":
            return json.dumps({**(extra or {}), **self.to_dict()}, indent=1, ensure_ascii=False) + "\n"
        return self.csv() if fmt == "csv" else self.markdown() + "\n"

    def write(self, path: str | os.PathLike, fmt: str, extra: dict | None = None) -> Path:
        """The table to `path` as `fmt` (json, csv, md), written whole or not at all."""
        path = Path(path)
        if not path.parent.is_dir():
            raise UserError(f"Cannot write {path}: folder {path.parent} does not exist.")
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(self.text(fmt, extra), encoding="utf-8")
        tmp.replace(path)
        return path


def family_table(report: EvalReport, metric: str = "flexible") -> FamilyTable:
    """The table of a family's evaluation (`report.models`: the rows, with `MATH` and `LANG` among them;
    `report.config.langs`: the columns)."""
    if metric not in METRICS:
        raise UserError(f"metric must be strict or flexible, not {metric!r}.")
    right: dict[tuple[str, str], dict[int, bool]] = {}
    for r in report.results:
        right.setdefault((r.model, r.lang), {})[r.index] = getattr(r, f"{metric}_correct")
    cells = {}
    for lang in report.config.langs:
        experts = [(e, right[(e, lang)]) for e in (MATH, LANG) if right.get((e, lang))]
        better, best = max(experts, key=lambda e: sum(e[1].values())) if experts else ("", {})
        for m in report.models:
            got = right.get((m, lang))
            if not got:
                continue
            k, n = sum(got.values()), len(got)
            lo, hi = clopper_pearson(k, n)
            p = None
            if m != better and best:
                both = sorted(got.keys() & best.keys())
                p = mcnemar([got[i] for i in both], [best[i] for i in both]).p if both else None
            cells[(m, lang)] = Cell(n, k, lo, hi, p, better)
    return FamilyTable(tuple(report.config.langs), tuple(report.models), cells, metric)


__all__ = ["FORMATS", "LANG", "MATH", "Cell", "FamilyTable", "family_table"]
