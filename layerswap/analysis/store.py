"""Analyses on disk: the .npz format, and the cache folder keyed by the checkpoints' fingerprints."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from layerswap.models.cache import cache_dir, prune
from layerswap.core.roles import EXPERTS
from layerswap.analysis.bins import Hist
from layerswap.analysis.records import RunInfo, TensorMeta, TopK

FORMAT_VERSION = 2  # 2: the checkpoints' model_type
CACHE_KEEP = 32  # analyses kept in a cache folder (a few MB each for an 8B model)


def save(an, path: str | os.PathLike) -> Path:
    """Write an `Analysis` as one .npz (JSON metadata plus arrays), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT_VERSION, "refs": an.refs, "fingerprints": an.fingerprints,
        "num_layers": an.num_layers, "model_type": an.model_type,
        "tensors": [[t.name, t.layer, t.ptype, list(t.shape), t.numel] for t in an.tensors],
        "topk": [{"k": tk.k, "K": tk.K, "N": tk.N, "threshold": tk.threshold, "passes": tk.passes}
                 for tk in an.topk.values()],
        "run": {k: v for k, v in vars(an.run).items() if k not in ("cached", "cache_file")},
    }
    arrays = {"base_sq": an.base_sq, "dot": an.dot, "ml_sq": an.ml_sq, "ml_abs": an.ml_abs}
    for r in EXPERTS:
        arrays[f"sq_{r}"], arrays[f"abs_{r}"] = an.sq[r], an.abs_sum[r]
        h = an.hist[r]
        arrays[f"hist_lo_{r}"], arrays[f"hist_off_{r}"], arrays[f"hist_{r}"] = h.lo, h.offsets, h.counts
    for j, tk in enumerate(an.topk.values()):
        arrays[f"topk{j}_joint"] = tk.joint
        for r in EXPERTS:
            arrays[f"topk{j}_gt_{r}"], arrays[f"topk{j}_eq_{r}"] = tk.n_gt[r], tk.n_eq[r]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    os.replace(tmp, path)
    return path


def read(path: str | os.PathLike) -> dict:
    """The fields of the `Analysis` saved at `path`; ValueError for another format version."""
    with np.load(path) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        if meta.get("format") != FORMAT_VERSION:
            raise ValueError(f"{path}: analysis format {meta.get('format')}, not {FORMAT_VERSION}")
        a = {k: z[k] for k in z.files if k != "meta"}
    tensors = [TensorMeta(n, layer, p, tuple(s), int(c)) for n, layer, p, s, c in meta["tensors"]]
    topk = {}
    for j, d in enumerate(meta["topk"]):
        topk[float(d["k"])] = TopK(float(d["k"]), int(d["K"]), int(d["N"]),
                                   {r: float(v) for r, v in d["threshold"].items()},
                                   {r: a[f"topk{j}_gt_{r}"] for r in EXPERTS},
                                   {r: a[f"topk{j}_eq_{r}"] for r in EXPERTS},
                                   a[f"topk{j}_joint"], int(d["passes"]))
    return dict(
        refs=meta["refs"], fingerprints=meta["fingerprints"], num_layers=int(meta["num_layers"]),
        model_type=meta["model_type"], tensors=tensors,
        base_sq=a["base_sq"], sq={r: a[f"sq_{r}"] for r in EXPERTS}, abs_sum={r: a[f"abs_{r}"] for r in EXPERTS},
        dot=a["dot"], ml_sq=a["ml_sq"], ml_abs=a["ml_abs"],
        hist={r: Hist(a[f"hist_lo_{r}"], a[f"hist_off_{r}"], a[f"hist_{r}"]) for r in EXPERTS},
        topk=topk, run=RunInfo(**meta["run"], cached=True, cache_file=str(path)),
    )


def cache_file(cache: bool | str | os.PathLike, fingerprints: dict[str, str], model_type: str) -> Path | None:
    """Where the analysis of these checkpoints is cached: `cache` is True (the default folder), a folder, or False."""
    if not cache:
        return None
    folder = cache_dir("analysis") if cache is True else Path(cache)
    key = {"v": FORMAT_VERSION, "fp": fingerprints, "model_type": model_type}
    return folder / f"{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]}.npz"


def remember(an, file: Path) -> None:
    """Save `an` to its cache file and keep the folder at `CACHE_KEEP` analyses (a read-only folder is no error)."""
    try:
        save(an, file)
        an.run.cache_file = str(file)
        prune(file.parent, "*.npz", CACHE_KEEP)
    except OSError:
        pass  # a read-only cache folder only costs the next run its speed
