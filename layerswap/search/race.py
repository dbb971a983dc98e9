"""Successive halving on questions: a candidate is scored on a few dev questions and promoted to more only while
it is not clearly behind the best plan so far, the paired standard error deciding.

    sizes = rungs(400, 25)                       # [25, 50, 100, 200, 400]: prefixes of the dev order
    r = race(score, dev_ids, sizes, incumbent_scores, z=2.0)

After each rung the candidate and the incumbent (the best plan evaluated on every dev question) are compared
on the same questions: the per-question difference (incumbent - candidate; a question's score is the share of
languages it was answered right in) has mean d and standard error se (`stats.paired_difference`). The
candidate stops when d > z·se, i.e. when it is behind by more than z paired standard errors; otherwise it is
promoted to the next rung. A candidate that reaches the last rung has its full dev score; it becomes the
incumbent when that score is higher. Without an incumbent (the first candidate) every rung is run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from layerswap.core.errors import UserError
from layerswap.core.stats import paired_difference

Z = 2.0


def rungs(n_dev: int, first: int | None = None) -> list[int]:
    """Question counts of the rungs: `first` (default max(10, n_dev/16)), doubling, ending at n_dev."""
    first = max(10, -(-n_dev // 16)) if first is None else first
    if not isinstance(first, int) or first < 1:
        raise UserError(f"The first rung is a number of questions >= 1, not {first!r}.")
    out, n = [], min(first, n_dev)
    while n < n_dev:
        out.append(n)
        n *= 2
    return out + [n_dev]


def behind(incumbent: Sequence[float], candidate: Sequence[float], z: float = Z) -> bool:
    """Is `candidate` behind `incumbent` on the same questions by more than z paired standard errors?"""
    d = paired_difference(incumbent[:len(candidate)], candidate)
    return d.diff > 0 and d.diff > z * d.se


@dataclass
class Race:
    scores: list[float] = field(default_factory=list)  # per dev question, in dev order (those evaluated)
    complete: bool = False  # scored on every dev question
    cancelled: bool = False
    reached: list[tuple[int, float]] = field(default_factory=list)  # (questions, mean score) after each rung

    @property
    def accuracy(self) -> float:
        return sum(self.scores) / len(self.scores) if self.scores else 0.0


def race(score: Callable[[list[int]], list[float] | None], dev: Sequence[int], sizes: Sequence[int],
         incumbent: Sequence[float] | None, z: float = Z) -> Race:
    """Score a candidate rung by rung; `score(ids)` gives the per-question scores of those ids (None: cancelled)."""
    r = Race()
    for n in sizes:
        got = score(list(dev[len(r.scores):n]))
        if got is None:
            r.cancelled = True
            return r
        r.scores += got
        r.reached.append((n, r.accuracy))
        if n < len(dev) and incumbent is not None and behind(incumbent, r.scores, z):
            return r
    r.complete = True
    return r
