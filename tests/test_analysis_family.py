"""layerswap.analysis.analyze_family: one math expert and N language experts analysed in one stream give
each pair's `Analysis` exactly (every array equal), read base and math once, and share the pair cache."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from layerswap import Checkpoint, UserError
from layerswap.analysis import analyze, analyze_family
from layerswap.shipped.demo import make_tiny_llama, perturb

pytestmark = pytest.mark.usefixtures("analysis_kernel")  # each CPU kernel (tests/conftest.py)

KS = (0.1, 1.0, 10.0)


@pytest.fixture(scope="module")
def family(tmp_path_factory, trio_bf16) -> dict[str, Path]:
    """The bf16 trio plus two more language experts: base, math, sw (the trio's lang), te, bn."""
    root = tmp_path_factory.mktemp("family")
    return {"base": trio_bf16["base"], "math": trio_bf16["math"], "sw": trio_bf16["lang"],
            "te": perturb(trio_bf16["base"], root / "te", scale=0.08, seed=7),
            "bn": perturb(trio_bf16["base"], root / "bn", scale=0.03, seed=8)}


def members(paths: dict[str, Path], codes) -> tuple[Checkpoint, Checkpoint, dict[str, Checkpoint]]:
    return (Checkpoint.open(paths["base"]), Checkpoint.open(paths["math"]),
            {c: Checkpoint.open(paths[c]) for c in codes})


def assert_same(a, b, where: str = "") -> None:
    """Every number of two analyses (or their parts) equal: arrays element for element, NaN where NaN."""
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            if f.name != "run":  # the time and bytes of the run that computed it
                assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b), where
    else:
        assert a == b, where


@pytest.mark.parametrize("codes", [("sw", "te"), ("sw", "te", "bn")])
@pytest.mark.parametrize("kw", [{}, {"workers": 2, "chunk_elems": 5000}, {"sample_fraction": 0},
                                {"chunk_elems": 777, "sample_block": 64, "sample_fraction": 0.02}],
                         ids=["sampled", "two-workers", "exact-passes", "small-chunks"])
def test_family_equals_separate_pair_analyses(family, codes, kw):
    base, math, langs = members(family, codes)
    fam = analyze_family(base, math, langs, ks=KS, cache=False, **kw)
    assert list(fam) == list(codes)
    for code in codes:
        pair = analyze(base, math, langs[code], ks=KS, cache=False, **kw)
        assert_same(fam[code], pair, code)
        assert fam[code].refs["lang"] == langs[code].ref and fam[code].run.passes == pair.run.passes
    assert fam["sw"].topk_at(1.0).threshold["lang"] != fam["te"].topk_at(1.0).threshold["lang"]  # distinct experts


def read_counter(monkeypatch, paths: dict[str, Path]) -> Counter:
    """Bytes read per member, counted at the system call every reader uses (os.preadv)."""
    folders = {str(p.resolve()): role for role, p in paths.items()}
    counts: Counter = Counter()
    real = os.preadv

    def preadv(fd, buffers, offset, *a):
        n = real(fd, buffers, offset, *a)
        folder = str(Path(os.readlink(f"/proc/self/fd/{fd}")).parent)
        counts[folders.get(folder, folder)] += n
        return n

    monkeypatch.setattr(os, "preadv", preadv)
    return counts


def test_base_and_math_are_read_once_for_the_family(family, monkeypatch):
    codes = ("sw", "te", "bn")
    base, math, langs = members(family, codes)
    one = sum(info.nbytes for info in base.tensors.values())
    counts = read_counter(monkeypatch, family)
    analyze(base, math, langs["sw"], ks=(1.0,), cache=False)
    pair = dict(counts)
    assert pair["base"] == pair["math"] == pair["sw"] > one  # the main pass, plus the sample
    counts.clear()
    analyze_family(base, math, langs, ks=(1.0,), cache=False)
    # N + 2 reads: each member exactly as much as in one pair analysis
    assert dict(counts) == {role: pair["base"] for role in ("base", "math", *codes)}


def test_family_and_pairs_share_the_cache(family, monkeypatch, tmp_path):
    base, math, langs = members(family, ("sw", "te"))
    sw = analyze(base, math, langs["sw"], ks=(1.0,), cache=tmp_path)
    counts = read_counter(monkeypatch, family)
    fam = analyze_family(base, math, langs, ks=(1.0,), cache=tmp_path)
    assert fam["sw"].run.cached and not fam["te"].run.cached
    assert set(counts) == {"base", "math", "te"}  # the cached language is not read again
    assert_same(fam["sw"], sw)
    counts.clear()
    te = analyze(base, math, langs["te"], ks=(1.0,), cache=tmp_path)
    assert te.run.cached and not counts
    assert_same(te, fam["te"])


def test_a_member_of_another_shape_is_refused_before_reading(family, monkeypatch, tmp_path, tokenizer):
    other = make_tiny_llama(tmp_path / "other", layers=3, seed=0, tokenizer=tokenizer)
    base, math, langs = members(family, ("sw",))
    langs["ja"] = Checkpoint.open(other)
    counts = read_counter(monkeypatch, family)
    with pytest.raises(UserError, match="language expert ja"):
        analyze_family(base, math, langs, cache=False)
    assert not counts
    with pytest.raises(UserError, match="at least one language"):
        analyze_family(base, math, {}, cache=False)

