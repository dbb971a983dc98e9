"""Small exact statistics for accuracies on a fixed question set (pure Python, no SciPy).

    clopper_pearson(30, 30)            # (0.8843, 1.0): the exact 95 % interval of 30/30
    mcnemar(a, b)                      # paired: questions only `a` got right, only `b` got right, exact p
    paired_difference(a, b)            # mean of a - b per question, its standard error and z
    paired_mean_se([a, b])             # standard error of the per-question mean over several languages

An accuracy is a binomial proportion: `clopper_pearson` gives its exact (conservative) interval, which
stays honest at 0/n and n/n where ``p ± SE`` collapses to a point. Two models scored on the same questions
are compared per question: `mcnemar` is the exact two-sided binomial test on the questions where they
disagree, `paired_difference` the size of the difference in standard errors (the z the targets use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence


def _log_pmf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 0.0 if k == 0 else -math.inf
    if p >= 1.0:
        return 0.0 if k == n else -math.inf
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    return min(1.0, math.fsum(math.exp(_log_pmf(i, n, p)) for i in range(k + 1)))


def _solve(f, target: float) -> float:
    """The p in [0, 1] where the decreasing function f(p) crosses `target` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if f(mid) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@lru_cache(maxsize=4096)
def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval of a proportion k/n."""
    if not 0 <= k <= n or n == 0:
        raise ValueError(f"need 0 <= k <= n and n > 0, got k={k}, n={n}")
    a = (1 - confidence) / 2
    lo = 0.0 if k == 0 else _solve(lambda p: binom_cdf(k - 1, n, p), 1 - a)  # P(X >= k | lo) = a
    hi = 1.0 if k == n else _solve(lambda p: binom_cdf(k, n, p), a)  # P(X <= k | hi) = a
    return lo, hi


@dataclass(frozen=True)
class McNemar:
    only_a: int  # questions `a` answered correctly and `b` did not
    only_b: int
    p: float  # exact two-sided p-value (1.0 when they never disagree)


def mcnemar(a: Sequence[bool], b: Sequence[bool]) -> McNemar:
    """Exact McNemar test of two models' per-question correctness on the same questions."""
    if len(a) != len(b):
        raise ValueError(f"paired results need the same questions ({len(a)} vs {len(b)})")
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    m = only_a + only_b
    p = 1.0 if m == 0 else min(1.0, 2 * binom_cdf(min(only_a, only_b), m, 0.5))
    return McNemar(only_a, only_b, p)


@dataclass(frozen=True)
class PairedDifference:
    diff: float  # mean of a - b per question
    se: float  # its standard error (sample SD of the differences / sqrt(n))
    z: float | None  # diff / se; None when every difference is the same (se 0)


def paired_difference(a: Sequence[float], b: Sequence[float]) -> PairedDifference:
    """Mean per-question difference a - b with its standard error; per-question scores are bools, or fractions
    (e.g. the share of languages a question was answered right in)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired results need the same, non-empty questions ({len(a)} vs {len(b)})")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / max(1, len(d) - 1))
    se = sd / math.sqrt(len(d))
    return PairedDifference(mean, se, mean / se if se else None)


def paired_mean_se(per_lang: Sequence[Sequence[bool]]) -> float:
    """Standard error of the accuracy averaged over languages whose question i is the same problem (MGSM's
    languages are translations of one set): the SE of the per-question mean, not sqrt(sum se^2) / k."""
    n = len(per_lang[0])
    if any(len(x) != n for x in per_lang) or n == 0:
        raise ValueError("every language needs the same, non-empty questions")
    m = [sum(int(x[i]) for x in per_lang) / len(per_lang) for i in range(n)]
    mean = sum(m) / n
    return math.sqrt(sum((v - mean) ** 2 for v in m) / max(1, n - 1)) / math.sqrt(n)


__all__ = ["McNemar", "PairedDifference", "binom_cdf", "clopper_pearson", "mcnemar", "paired_difference",
           "paired_mean_se"]
