"""layerswap.core.stats against closed forms and, where installed, SciPy (an independent implementation)."""

from __future__ import annotations

import math
import random

import pytest

from layerswap.core.stats import binom_cdf, clopper_pearson, mcnemar, paired_difference, paired_mean_se


def test_clopper_pearson_closed_forms():
    # 0/n and n/n have closed forms: upper = 1 - (a/2)^(1/n), lower = (a/2)^(1/n)
    for n in (1, 30, 300, 1000):
        lo, hi = clopper_pearson(0, n)
        assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / n), abs=1e-9)
        lo, hi = clopper_pearson(n, n)
        assert hi == 1.0 and lo == pytest.approx(0.025 ** (1 / n), abs=1e-9)
    assert clopper_pearson(0, 30)[1] == pytest.approx(0.1157, abs=5e-5)  # the issue's [0, 11.6]
    lo, hi = clopper_pearson(1, 2)  # symmetric: P(X >= 1 | lo) = 1 - (1 - lo)^2 = 0.025
    assert lo == pytest.approx(1 - math.sqrt(0.975), abs=1e-9) and hi == pytest.approx(math.sqrt(0.975), abs=1e-9)
    with pytest.raises(ValueError):
        clopper_pearson(3, 2)


def test_mcnemar_by_hand():
    a = [True] * 5 + [False] * 3
    b = [False] * 5 + [False] * 3
    m = mcnemar(a, b)  # 5 discordant, all one way: p = 2 * 0.5^5
    assert (m.only_a, m.only_b) == (5, 0) and m.p == pytest.approx(0.0625)
    assert mcnemar(a, a).p == 1.0
    m = mcnemar([True, False, True], [False, True, True])  # one each way: p = min(1, 2 * 0.75)
    assert m.p == 1.0
    assert binom_cdf(2, 4, 0.5) == pytest.approx(11 / 16)


def test_paired_statistics_by_hand():
    d = paired_difference([True, True, False, True], [False, True, False, False])
    assert d.diff == 0.5 and d.se == pytest.approx(math.sqrt(1 / 3) / 2) and d.z == pytest.approx(0.5 / d.se)
    assert paired_difference([True, False], [True, False]).z is None
    same = [True, False, True, True]
    # two languages with identical outcomes per question: the average is that language, its SE too
    assert paired_mean_se([same, same]) == pytest.approx(paired_mean_se([same]))
    assert paired_mean_se([same]) == pytest.approx(math.sqrt(0.75 * 0.25 * 4 / 3 / 4))


def test_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    for n, k in [(30, 12), (300, 1), (300, 299), (1000, 977), (1000, 413), (7, 3)]:
        ref = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
        lo, hi = clopper_pearson(k, n)
        assert lo == pytest.approx(ref.low, abs=1e-9) and hi == pytest.approx(ref.high, abs=1e-9)
        assert binom_cdf(k, n, 0.37) == pytest.approx(stats.binom.cdf(k, n, 0.37), abs=1e-12)
    for _ in range(20):
        n = rng.randint(5, 400)
        a = [rng.random() < 0.6 for _ in range(n)]
        b = [rng.random() < rng.random() for _ in range(n)]
        m = mcnemar(a, b)
        want = 1.0 if m.only_a + m.only_b == 0 else stats.binomtest(m.only_a, m.only_a + m.only_b, 0.5).pvalue
        assert m.p == pytest.approx(want, abs=1e-12)
