"""layerswap.analysis.store: saved analyses read back equal, and the cache folder keyed by fingerprints."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from layerswap import Checkpoint
from layerswap.analysis import Analysis, analyze, store


def analysis_of(paths: dict[str, Path], **kw) -> Analysis:
    c = {r: Checkpoint.open(paths[r]) for r in ("base", "math", "lang")}
    return analyze(c["base"], c["math"], c["lang"], **kw)


@pytest.fixture
def paths(trio, tmp_path) -> dict[str, Path]:
    """A copy of the trio this test may change."""
    return {r: Path(shutil.copytree(trio[r], tmp_path / r)) for r in ("base", "math", "lang")}


def test_cache_hit_and_invalidation(paths, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = analysis_of(paths, ks=(1.0,), cache=cache)
    assert not first.run.cached and len(list(cache.glob("*.npz"))) == 1
    again = analysis_of(paths, ks=(1.0,), cache=cache)
    assert again.run.cached
    for r in ("math", "lang"):
        np.testing.assert_array_equal(again.sq[r], first.sq[r])
        np.testing.assert_array_equal(again.topk_at(1.0).count(r), first.topk_at(1.0).count(r))
        np.testing.assert_array_equal(again.hist[r].counts, first.hist[r].counts)
    # a new k recomputes once and keeps the old one; both are then hits
    more = analysis_of(paths, ks=(5.0,), cache=cache)
    assert not more.run.cached and more.ks == [1.0, 5.0]
    assert analysis_of(paths, ks=(1.0, 5.0), cache=cache).run.cached
    # change one value of the language expert: the fingerprint changes, the analysis reruns
    sd = load_file(paths["lang"] / "model.safetensors")
    name = "model.layers.2.mlp.up_proj.weight"
    sd[name] = sd[name].clone()
    sd[name][0, 0] += 1.0
    save_file(sd, paths["lang"] / "model.safetensors", metadata={"format": "pt"})
    changed = analysis_of(paths, ks=(1.0,), cache=cache)
    assert not changed.run.cached
    i = changed.index(name)
    assert changed.sq["lang"][i] > first.sq["lang"][i]
    assert analysis_of(paths, ks=(1.0,), cache=cache).run.cached
    # a corrupt cache file is recomputed, not trusted
    for f in cache.glob("*.npz"):
        f.write_bytes(b"garbage")
    assert not analysis_of(paths, ks=(1.0,), cache=cache).run.cached
    # a new result keeps the folder at CACHE_KEEP analyses, the newest
    monkeypatch.setattr(store, "CACHE_KEEP", 3)
    for j in range(5):
        (cache / f"old{j}.npz").write_bytes(b"x")
    newest = analysis_of(paths, ks=(2.0,), cache=cache)
    assert len(list(cache.glob("*.npz"))) == 3 and Path(newest.run.cache_file).exists()


def test_an_older_format_is_recomputed(paths, tmp_path, monkeypatch):
    first = analysis_of(paths, cache=tmp_path / "cache")
    file = Path(first.run.cache_file)
    with monkeypatch.context() as m:
        m.setattr(store, "FORMAT_VERSION", 1)
        store.save(first, file)
    with pytest.raises(ValueError, match="format 1"):
        Analysis.load(file)
    again = analysis_of(paths, cache=tmp_path / "cache")
    assert not again.run.cached and Analysis.load(file).model_type == "llama"


def test_save_and_load_roundtrip(trio, tmp_path):
    an = analysis_of(trio, ks=(1.0, 10.0), cache=False)
    back = Analysis.load(an.save(tmp_path / "a.npz"))
    assert back.tensors == an.tensors and back.ks == an.ks
    assert back.model_type == an.model_type == "llama" and back.row_labels == an.row_labels
    assert back.rows(10.0) == an.rows(10.0)
    assert back.run.cached and back.run.cache_file == str(tmp_path / "a.npz")
