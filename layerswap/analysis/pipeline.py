"""`analyze()` and `analyze_family()`: check the checkpoints, answer from the cache when it can, else run the
passes and cache the result (one cached `Analysis` per pair, whichever of the two computed it)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

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
    return analyze_family(base, math, {"lang": lang}, ks=ks, device=device, cache=cache, progress=progress,
                          chunk_elems=chunk_elems, sample_fraction=sample_fraction,
                          sample_max_entries=sample_max_entries, sample_block=sample_block, max_kept=max_kept,
                          workers=workers)["lang"]


def analyze_family(base: Checkpoint, math: Checkpoint, langs: Mapping[str, Checkpoint], *,
                   ks: Sequence[float] = DEFAULT_KS, device: str = "cpu", cache: bool | str | os.PathLike = True,
                   progress: Progress | None = None, chunk_elems: int | None = None,
                   sample_fraction: float = 1 / 256, sample_max_entries: int = 1 << 21, sample_block: int = 8192,
                   max_kept: int = 1 << 22, workers: int = 1) -> dict[str, Analysis]:
    """The `Analysis` of (base, math, lang) for every language expert of `langs` (code -> checkpoint),
    equal to one `analyze` call per language, streaming base, math and every language not in the
    cache together tensor by tensor: N + 2 checkpoint reads instead of 3N. Options as in `analyze`.

    Every member is checked against the base and the math expert before anything is read. A
    language whose top-k% window missed costs two more passes over its own pair only (rare).
    The `run` of each computed analysis describes the shared run (its time, every byte read).
    """
    if not langs:
        raise UserError("Give at least one language expert to analyse.")
    if workers < 1:
        raise UserError(f"workers must be at least 1 (got {workers}).")
    ks = sorted({float(k) for k in ks})
    for k in ks:
        if not 0 < k <= 100:
            raise UserError(f"k is a percentage in (0, 100]; got {k}.")
    device = resolve_device(device, allowed=("cpu", "cuda"))
    for code, lang in langs.items():
        rep = check_compatible(math, lang, base)
        if not rep.ok:
            who = "" if len(langs) == 1 else f" (language expert {code}: {lang.ref})"
            raise UserError(f"Cannot analyse these models{who}: {rep.errors[0].what}: {rep.errors[0].detail}.")
    out: dict[str, Analysis] = {}
    todo: dict[str, _Pair] = {}
    for code, lang in langs.items():
        pair = _Pair(base, math, lang, cache, list(ks))
        hit = pair.cached()
        if hit is not None and all(any(same_k(k, x) for x in hit.ks) for k in ks):
            out[code] = hit
        else:
            if hit is not None:  # keep every k computed so far
                pair.ks = sorted(set(ks) | set(hit.ks))
            todo[code] = pair
    if todo:
        out.update(_compute(base, math, todo, ks, device, progress, chunk_elems, sample_fraction,
                            sample_max_entries, sample_block, max_kept, workers))
    elif progress:
        progress(1.0, "loaded from the cache")
    return {code: out[code] for code in langs}


@dataclass
class _Pair:
    """One (base, math, lang) of a family: its identity, cache file and the ks it needs."""

    base: Checkpoint
    math: Checkpoint
    lang: Checkpoint
    cache: bool | str | os.PathLike
    ks: list[float]

    def __post_init__(self) -> None:
        self.fps = {"base": self.base.fingerprint(), "math": self.math.fingerprint(), "lang": self.lang.fingerprint()}
        self.refs = {"base": self.base.ref, "math": self.math.ref, "lang": self.lang.ref}
        self.cache_file = store.cache_file(self.cache, self.fps, self.base.model_type)

    def cached(self) -> Analysis | None:
        """The cached analysis of these checkpoints, if there is a readable one of this format."""
        if self.cache_file is None or not self.cache_file.exists():
            return None
        try:
            hit = Analysis.load(self.cache_file)
        except Exception:  # unreadable or older format: recompute and overwrite
            return None
        if hit.fingerprints != self.fps or hit.model_type != self.base.model_type:
            return None
        hit.refs = self.refs
        return hit


def _compute(base: Checkpoint, math: Checkpoint, todo: dict[str, _Pair], ks: list[float], device: str,
             progress: Progress | None, chunk_elems: int | None, sample_fraction: float, sample_max_entries: int,
             sample_block: int, max_kept: int, workers: int) -> dict[str, Analysis]:
    t0 = time.perf_counter()
    infos = sorted((info for info in base.tensors.values() if info.torch_dtype.is_floating_point),
                   key=lambda i: (str(i.file), i.start))
    if not infos:
        raise UserError(f"{base.ref} holds no floating-point tensors to compare.")
    tensors = [TensorMeta(i.name, i.layer, i.ptype, tuple(i.shape), i.numel) for i in infos]
    from layerswap.analysis.passes import compute  # torch: loaded when there is something to compute

    all_ks = sorted(set(ks).union(*(p.ks for p in todo.values())))
    computed = compute([base, math, *(p.lang for p in todo.values())], tensors, all_ks, device,
                       chunk=chunk_elems or default_chunk(device), sample_fraction=sample_fraction,
                       sample_max_entries=sample_max_entries, sample_block=sample_block, max_kept=max_kept,
                       workers=workers, progress=progress)
    seconds = time.perf_counter() - t0
    out = {}
    for (code, pair), c in zip(todo.items(), computed):
        s = c.sums
        topk = {k: v for k, v in c.topk.items() if any(same_k(k, x) for x in pair.ks)}
        an = Analysis(
            refs=pair.refs, fingerprints=pair.fps, num_layers=math.num_layers, model_type=base.model_type,
            tensors=tensors, base_sq=s[0], sq={"math": s[1], "lang": s[2]}, abs_sum={"math": s[4], "lang": s[5]},
            dot=s[3], ml_sq=s[6], ml_abs=s[7], hist=c.hists, topk=topk,
            run=RunInfo(seconds, c.passes, c.bytes_read, device, c.sample_entries, workers),
        )
        if pair.cache_file is not None:
            store.remember(an, pair.cache_file)
        out[code] = an
    if progress:
        progress(1.0, "done")
    return out

