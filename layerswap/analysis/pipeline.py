"""`analyze()`: check the checkpoints, answer from the cache when it can, else run the passes and cache the result."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

from layerswap.models.checkpoints import Checkpoint, check_compatible
from layerswap.core.errors import UserError
from layerswap.core.runtime import Progress, resolve_device
from layerswap.analysis import store
from layerswap.analysis.records import DEFAULT_KS, RunInfo, TensorMeta, same_k
from layerswap.analysis.results import Analysis
from layerswap.analysis.stream import default_chunk


def analyze(base: Checkpoint, math: Checkpoint, lang: Checkpoint, *, ks: Sequence[float] = DEFAULT_KS,
            device: str = "cpu", cache: bool | str | os.PathLike = True, progress: Progress | None = None,
            chunk_elems: int | None = None, sample_fraction: float = 1 / 256,
            sample_max_entries: int = 1 << 21, sample_block: int = 8192, max_kept: int = 1 << 22,
            workers: int = 1) -> Analysis:
    """Stream base, math and language expert once and compute every statistic (package docstring).

    `ks`: top-k percentages to compute exactly (0 < k <= 100). `cache`: True (the default
    folder), a folder, or False. `sample_fraction=0` skips the sample and always locates the
    thresholds with two more exact passes. `max_kept` bounds the window entries kept in memory
    (distinct values per tensor); past it the window is dropped for the exact passes.
    `workers`: threads that each stream their own share of the tensors (CPU: at most one per free
    core; the compiled CPU pass sets torch's own threads to 1 while it runs, see `runtime.torch_threads`).
    Results do not depend on it.
    """
    if workers < 1:
        raise UserError(f"workers must be at least 1 (got {workers}).")
    ks = sorted({float(k) for k in ks})
    for k in ks:
        if not 0 < k <= 100:
            raise UserError(f"k is a percentage in (0, 100]; got {k}.")
    device = resolve_device(device, allowed=("cpu", "cuda"))
    rep = check_compatible(math, lang, base)
    if not rep.ok:
        raise UserError(f"Cannot analyse these models: {rep.errors[0].what}: {rep.errors[0].detail}.")
    fps = {"base": base.fingerprint(), "math": math.fingerprint(), "lang": lang.fingerprint()}
    refs = {"base": base.ref, "math": math.ref, "lang": lang.ref}
    model_type = base.model_type
    cache_file = store.cache_file(cache, fps, model_type)
    hit = _cached(cache_file, fps, model_type)
    if hit is not None:
        if all(any(same_k(k, x) for x in hit.ks) for k in ks):
            hit.refs = refs
            if progress:
                progress(1.0, "loaded from the cache")
            return hit
        ks = sorted(set(ks) | set(hit.ks))  # keep every k computed so far
    t0 = time.perf_counter()
    infos = sorted((info for info in base.tensors.values() if info.torch_dtype.is_floating_point),
                   key=lambda i: (str(i.file), i.start))
    if not infos:
        raise UserError(f"{base.ref} holds no floating-point tensors to compare.")
    tensors = [TensorMeta(i.name, i.layer, i.ptype, tuple(i.shape), i.numel) for i in infos]
    from layerswap.analysis.passes import compute  # torch: loaded when there is something to compute

    c = compute([base, math, lang], tensors, ks, device, chunk=chunk_elems or default_chunk(device),
                sample_fraction=sample_fraction, sample_max_entries=sample_max_entries, sample_block=sample_block,
                max_kept=max_kept, workers=workers, progress=progress)
    s = c.sums
    an = Analysis(
        refs=refs, fingerprints=fps, num_layers=math.num_layers, model_type=model_type,
        tensors=tensors, base_sq=s[0], sq={"math": s[1], "lang": s[2]}, abs_sum={"math": s[4], "lang": s[5]},
        dot=s[3], ml_sq=s[6], ml_abs=s[7], hist=c.hists, topk=c.topk,
        run=RunInfo(time.perf_counter() - t0, c.passes, c.bytes_read, device, c.sample_entries, workers),
    )
    if cache_file is not None:
        store.remember(an, cache_file)
    if progress:
        progress(1.0, "done")
    return an


def _cached(cache_file: Path | None, fingerprints: dict[str, str], model_type: str) -> Analysis | None:
    """The cached analysis of these checkpoints, if there is a readable one of this format."""
    if cache_file is None or not cache_file.exists():
        return None
    try:
        hit = Analysis.load(cache_file)
    except Exception:  # unreadable or older format: recompute and overwrite
        return None
    return hit if hit.fingerprints == fingerprints and hit.model_type == model_type else None
