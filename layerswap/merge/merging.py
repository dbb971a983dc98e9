"""Merging: in-memory merges, and streaming export to an HF-format folder.

Every output tensor gets its source (`TensorSource`) from the planner, `layerswap.recipe.sources`. With layer
swapping (and any per-layer map), a tensor with weight ``w == 0`` or ``w == 1`` is a copy of the math or
language expert's tensor, and a tensor of a reverted layer a copy of the base model's (in memory:
the same tensor object; on disk: the same bytes, no dtype round trip). A tensor in between is
``(1-w)*math + w*lang`` in float32 (`methods.linear`, bit-identical to mergekit's ``linear``),
cast back to the checkpoint dtype. Other methods (soup, task arithmetic, TIES, DARE) compute
every tensor with their function from `methods`.

Export streams: copies go file to file (``copy_file_range``, all shards' copies in one background
thread); computed tensors are read with ``pread`` into reused buffers in slices of `CHUNK_ELEMS`
elements (whole tensors for TIES/DARE, whose trim or random mask needs the full tensor), merged on
the chosen device (on CPU in steps of `CPU_STEP`, allocating nothing), and written at once. Peak
memory is a few slices (or the largest tensor for TIES/DARE), whatever the model size.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

from layerswap.models.architectures import Architecture
from layerswap.merge.card import check_languages, provenance, write_card, write_mark
from layerswap.models.checkpoints import Checkpoint, TensorInfo
from layerswap.models.pairing import BASE_DISTANCE_THRESHOLD, Pairing, check_mergeable
from layerswap.core.errors import UserError
from layerswap.recipe.methods import MethodConfig, linear
from layerswap.merge.outputs import EXPORT_MARK, check_output_folder, input_paths
from layerswap.recipe.plans import Plan
from layerswap.recipe.recipes import Recipe, as_recipe
from layerswap.core.runtime import Progress, resolve_device
from layerswap.core.scratch import check_disk
from layerswap.recipe.sources import Sources, TensorSource
from layerswap.models.tensorfile import ITEMSIZE, ShardWriter, torch_dtype

if TYPE_CHECKING:  # torch loads only when a tensor is computed: copies and checks start without it
    import torch

DEFAULT_SHARD_BYTES = 5 * 10**9
CHUNK_ELEMS = 1 << 20  # elements per read when merging a large tensor in pieces
# elements per blend step on CPU: under torch's parallel grain size (32768), so no worker threads
# wake for it (on a busy 2-core machine they spun 10x the work) and the step stays in cache
CPU_STEP = 1 << 15


def blend(math: "torch.Tensor", lang: "torch.Tensor", w: float) -> "torch.Tensor":
    """``(1-w)*math + w*lang`` in float32, cast to math's dtype; w=0/1 return the input itself."""
    if w == 0.0:
        return math
    if w == 1.0:
        return lang
    return linear([math, lang.to(math.device)], [1.0 - w, w]).to(math.dtype)


def blend_into(out: "torch.Tensor", math: "torch.Tensor", lang: "torch.Tensor", w: float, acc: "torch.Tensor",
               scratch: "torch.Tensor") -> "torch.Tensor":
    """`blend` of flat slices written into `out` (math's dtype, on the CPU) in steps of ``len(acc)``,
    through the float32 buffers `acc` and `scratch` (on the computing device): allocates nothing,
    and gives the same bits as `blend` wherever the steps fall."""
    step = len(acc)
    for s in range(0, len(out), step):
        e = min(s + step, len(out))
        res = linear([math[s:e].to(acc.device), lang[s:e].to(acc.device)], [1.0 - w, w], out=acc[:e - s],
                     scratch=scratch[:e - s])
        out[s:e].copy_(res)  # rounded to the checkpoint dtype exactly as .to() rounds
    return out


def merge_in_memory(math: Mapping[str, "torch.Tensor"], lang: Mapping[str, "torch.Tensor"], num_layers: int,
                    recipe: Recipe | Plan | Sources, base: Callable[[str], "torch.Tensor"] | None = None,
                    progress: Progress | None = None, arch: Architecture | None = None) -> dict[str, "torch.Tensor"]:
    """Merge loaded state dicts with any recipe; `base(name)` supplies base tensors when needed. The recipe's
    planner may be given made (`Sources` of `num_layers` layers and `arch`: the caller's, not made again)."""
    sources = recipe if isinstance(recipe, Sources) else Sources(as_recipe(recipe), num_layers, arch)
    recipe = sources.recipe
    method = recipe.method
    recipes = sources.of(math)
    recipe.require_base(base is not None, "load the base model as well")
    out = {}
    for i, (name, r) in enumerate(recipes.items()):
        out[name] = _merged_tensor(name, r, math[name], lang[name], base, method)
        if progress and i % 16 == 0:
            progress(i / len(recipes), name)
    return out


def _merged_tensor(name: str, r: TensorSource, m: "torch.Tensor", l: "torch.Tensor",
                   base: Callable[[str], "torch.Tensor"] | None, method: MethodConfig) -> "torch.Tensor":
    """One merged tensor from its source `r` (a copy is the input tensor itself)."""
    if r.kind == "copy":
        return m if r.role == "math" else l if r.role == "lang" else base(name).to(m.device)
    if r.kind == "blend":
        return blend(m, l, r.w)
    b = base(name).to(m.device) if method.spec.needs_base else None
    return method.spec.fn(method, name, b, [m, l.to(m.device)]).to(m.dtype)


def merge_stream(math: Checkpoint, lang: Checkpoint, recipe: Recipe | Plan, *, base: Checkpoint | None = None,
                 force: bool = False) -> Callable[[], Iterator[tuple[str, "torch.Tensor"]]]:
    """The merge as a stream of ``(name, tensor)`` in checkpoint names, for loading into a running engine with no
    file written (`engines.vllm_engine.TensorWeights`).

    Args:
        math, lang, base: the checkpoints, read tensor by tensor (peak memory: one tensor of each input).
        recipe: any recipe; checked here, with the same checks as `export_merge`, before anything is read.
        force: waive the shared-base distance check.

    Returns:
        A function that yields the merged tensors each time it is called (the same bits as `merge_in_memory` and
        `export_merge`).
    """
    recipe = as_recipe(recipe)
    recipe.method.validate()
    if adapter_pair(math, lang) == "prefix":
        raise UserError("Prefix-tuning experts cannot be densified (a prefix changes no weight): the transformers "
                        "engine runs them (--engine transformers).")
    check_mergeable(math, lang, base, force=force).raise_if_bad()
    recipe.require_base(base is not None)
    recipes = Sources(recipe, math.num_layers, math.arch).of(math.tensors)
    get = (lambda n: base.read(n)) if base is not None else None

    def tensors() -> Iterator[tuple[str, "torch.Tensor"]]:
        for name, r in recipes.items():
            src = {"math": math, "lang": lang, "base": base}[r.role] if r.kind == "copy" else None
            if src is not None:  # a copy: read once, from its own checkpoint
                yield name, src.read(name)
                continue
            yield name, _merged_tensor(name, r, math.read(name), lang.read(name), get, recipe.method)

    return tensors


@dataclass
class MergeSummary:
    out: Path
    n_tensors: int
    n_copied: int
    n_blended: int
    bytes_written: int
    shards: int
    layer_weights: list[float] | None
    pairing: Pairing | None = None


def export_merge(math: Checkpoint, lang: Checkpoint, recipe: Recipe | Plan, out: str | os.PathLike, *,
                 base: Checkpoint | None = None, device: str = "auto",
                 shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, force: bool = False,
                 base_distance_threshold: float = BASE_DISTANCE_THRESHOLD, protect: tuple = (),
                 languages: list[str] | None = None, card: bool = True,
                 progress: Progress | None = None) -> MergeSummary:
    """Stream the merge to an HF folder: config, tokenizer, safetensors shards, model card.

    The card (README.md, from layerswap.json: see `layerswap.merge.card`) lists `languages` (ISO codes)
    in its front matter; `layerswap.merge.card.attach_eval` adds MGSM results later. With ``card=False``
    (a scratch merge nobody publishes) only the ``layerswap.json`` mark is written, without the card
    and the mergekit config.

    Checks run before any weights are read in bulk: headers (architecture, layers, names,
    shapes, dtypes), the plan, and sampled distances from the base (refused above the threshold
    unless `force`). Output goes to a temporary sibling folder renamed into place at the end, so
    a failure leaves nothing half-written. The output may not touch an input (nor the folders in
    `protect`), and `overwrite` replaces only an earlier export (`layerswap.merge.outputs`).
    """
    recipe = as_recipe(recipe)
    method = recipe.method
    method.validate()
    languages = check_languages(languages)
    if adapter_pair(math, lang) == "prefix":
        raise UserError("Prefix-tuning experts cannot be densified (a prefix changes no weight): export the swap as "
                        "a prefix-tuning adapter (`merging.export_adapter_merge`; `layerswap merge` does so by itself).")
    check = check_mergeable(math, lang, base, threshold=base_distance_threshold, force=force)
    check.raise_if_bad()
    pairing = check.pairing
    recipe.require_base(base is not None)
    sources = Sources(recipe, math.num_layers, math.arch)
    recipes = sources.of(math.tensors)
    # torch (and a device) only matter when a tensor is computed: a copy-only merge never imports it
    if any(r.kind != "copy" for r in recipes.values()):
        # an explicit device is checked now; "auto" asks torch for a GPU at the first computed tensor, so the
        # copies start without waiting for torch's import (seconds)
        device = device if (device or "auto").strip().lower() == "auto" else resolve_device(device, ("cpu", "cuda"))
    else:
        device = "cpu"
    out = check_output_folder(out, input_paths(math, lang, base, extra=protect), overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_disk(math.nbytes, out.parent, f"the merged model to {out.name}")  # before a byte is written
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        shards = _plan_shards(list(math.tensors.values()), shard_bytes)
        total = sum(t.nbytes for t in math.tensors.values())
        done, lock = 0, threading.Lock()
        names_to_file: dict[str, str] = {}

        work = _Workspace(device)

        def compute(info: TensorInfo, write) -> None:
            _write_computed(write, info, recipes[info.name], math, lang, base, method, work)

        def source(info: TensorInfo) -> TensorInfo | None:
            r = recipes[info.name]
            if r.kind != "copy":
                return None
            return {"math": math, "lang": lang, "base": base}[r.role].tensors[info.name]

        def tick(info: TensorInfo) -> None:  # called from copy threads too
            nonlocal done
            with lock:
                done += info.nbytes
                if progress:
                    progress(done / total, f"{info.name} ({recipes[info.name].label(sources.method_title)})")

        files = []
        for i, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            files.append((tmp / fname, shard))
            names_to_file.update({info.name: fname for info in shard})
        _write_shards(files, source, compute, tick)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(names_to_file.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        _copy_side_files(math, tmp)
        if card:
            write_card(tmp, provenance(math, lang, base, sources, pairing, bool(pairing.suspicious and force), languages))
        else:
            write_mark(tmp, sources.recipe)
        _atomic_replace(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n_copied = sum(1 for r in recipes.values() if r.kind == "copy")
    return MergeSummary(out, len(recipes), n_copied, len(recipes) - n_copied, total, len(shards),
                        sources.layer_weights, pairing)


class _Workspace:
    """Buffers an export reuses for every computed slice: the inputs' bytes and the float32 working space."""

    def __init__(self, device: str):
        self._device_arg = device
        self._device: "torch.device | None" = None
        self._bufs: dict[str, "torch.Tensor"] = {}

    @property
    def device(self) -> "torch.device":
        """The device, resolved (and torch imported) when the first tensor is computed."""
        if self._device is None:
            import torch

            self._device = torch.device(resolve_device(self._device_arg, ("cpu", "cuda")))
        return self._device

    @property
    def step(self) -> int | None:
        """Elements per blend step: `CPU_STEP` on CPU; None (a whole slice per step) on a GPU."""
        return CPU_STEP if self.device.type == "cpu" else None

    def buffer(self, key: str, n: int, dtype: "torch.dtype", device: "torch.device | None" = None) -> "torch.Tensor":
        """`n` elements of a buffer kept under `key` (grown when too small)."""
        import torch

        b = self._bufs.get(key)
        if b is None or b.numel() < n or b.dtype != dtype:
            b = self._bufs[key] = torch.empty(max(n, 1), dtype=dtype, device=device or "cpu")
        return b[:n]

    def read(self, key: str, ck: Checkpoint, info: TensorInfo, start: int, n: int) -> "torch.Tensor":
        """Elements ``start .. start+n`` of `ck`'s copy of the tensor, read into the buffer `key` (on the CPU)."""
        import torch

        raw = self.buffer(key, n * ITEMSIZE[info.dtype], torch.uint8)
        ck.read_into(info.name, start, memoryview(raw.numpy()))
        return raw.view(torch_dtype(info.dtype))

    def blend(self, m: "torch.Tensor", l: "torch.Tensor", w: float) -> memoryview:
        """The bytes of ``(1-w)*m + w*l`` (`linear`, so bit-identical to mergekit) in m's dtype, step by step."""
        import torch

        n = m.numel()
        step = min(self.step or n, max(n, 1))
        acc = self.buffer("acc", step, torch.float32, self.device)
        scratch = self.buffer("scratch", step, torch.float32, self.device)
        return _tensor_bytes(blend_into(self.buffer("out", n, m.dtype), m, l, w, acc, scratch))


def _write_computed(write: Callable[[memoryview], None], info: TensorInfo, r: TensorSource, math: Checkpoint,
                    lang: Checkpoint, base: Checkpoint | None, method: MethodConfig, work: _Workspace) -> None:
    """Merge one tensor slice by slice (or whole, for TIES/DARE), passing its bytes to `write` in order."""
    spec = method.spec
    dev = work.device
    if r.kind == "method" and not spec.chunkable:  # the trim / random mask needs the whole tensor
        m, l = math.read(info.name).to(dev), lang.read(info.name).to(dev)
        b = base.read(info.name).to(dev) if spec.needs_base else None
        write(_tensor_bytes(spec.fn(method, info.name, b, [m, l]).to(m.dtype)))
        return
    for start in range(0, max(info.numel, 1), CHUNK_ELEMS):
        n = min(CHUNK_ELEMS, info.numel - start)
        m, l = work.read("math", math, info, start, n), work.read("lang", lang, info, start, n)
        if r.kind == "blend":
            write(work.blend(m, l, r.w))
            continue
        b = work.read("base", base, info, start, n).to(dev) if spec.needs_base else None
        write(_tensor_bytes(spec.fn(method, info.name, b, [m.to(dev), l.to(dev)]).to(m.dtype)))


def _write_shards(files: list[tuple[Path, list[TensorInfo]]], source: Callable[[TensorInfo], TensorInfo | None],
                  compute: Callable, tick: Callable[[TensorInfo], None]) -> None:
    """Write the safetensors files. Every tensor's place is known from the headers, so the copies of
    every shard run in one background thread (kernel-side `copy_file_range`) while computed tensors
    are produced and written at their offsets here."""
    from concurrent.futures import ThreadPoolExecutor

    with ExitStack() as stack:
        writers = [stack.enter_context(ShardWriter(path, [(t.name, t.dtype, t.shape) for t in shard]))
                   for path, shard in files]
        # every copy is queued first: the kernel copies while this thread computes (and, the
        # first time, imports torch); one copier is as fast as several on one disk
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = []
            try:
                for w, (_, shard) in zip(writers, files):
                    for info in shard:
                        src = source(info)
                        if src is not None:
                            fut = pool.submit(w.copy_from, src.file, src.start, src.nbytes, w.offsets[info.name],
                                              what=info.name)
                            fut.add_done_callback(lambda f, info=info: not f.cancelled() and f.exception() is None
                                                  and tick(info))
                            pending.append(fut)
                for w, (_, shard) in zip(writers, files):
                    for info in shard:
                        if source(info) is None:
                            cursor = w.offsets[info.name]

                            def write(buf: memoryview, w=w) -> None:
                                nonlocal cursor
                                w.write_at(cursor, buf)
                                cursor += len(buf)

                            compute(info, write)
                            tick(info)
                for fut in pending:
                    fut.result()
            except BaseException:
                for fut in pending:  # a failed merge stops at once: the copies still queued are dropped
                    fut.cancel()
                raise


def _plan_shards(infos: list[TensorInfo], shard_bytes: int) -> list[list[TensorInfo]]:
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    for t in infos:
        if shards[-1] and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    # widest dtypes first inside a shard keeps every tensor aligned to its element size
    return [sorted(s, key=lambda t: -ITEMSIZE[t.dtype]) for s in shards]


def _tensor_bytes(t: "torch.Tensor") -> memoryview:
    import torch

    t = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def adapter_pair(math: Checkpoint, lang: Checkpoint) -> str | None:
    """The kind both experts' adapters share (``lora``, ``ia3``, ``prefix``), or None (a full model, mixed kinds).
    A prefix-tuning expert beside anything else is refused: a prefix cannot be densified."""
    kinds = {math.adapter_kind, lang.adapter_kind}
    if "prefix" in kinds and len(kinds) > 1:
        raise UserError("A prefix-tuning expert merges only with another prefix-tuning expert: a prefix changes no "
                        "weight, so it cannot be densified beside a full model or another kind of adapter.")
    return math.adapter_kind if len(kinds) == 1 else None


def exports_as_adapter(math: Checkpoint, lang: Checkpoint, adapter: bool) -> bool:
    """Whether a merge is written as a PEFT adapter: when asked (`adapter`), and always for two prefix-tuning
    experts, whose swap exists only on the adapters (a prefix changes no weight)."""
    return adapter or adapter_pair(math, lang) == "prefix"


def merged_adapter(math: Checkpoint, lang: Checkpoint, recipe: Recipe | Plan, base: Checkpoint | None = None):
    """The swap of two adapter experts of one kind, done on the adapters (`adapter_merge.swap_adapters`):
    returns the merged `adapters.AdapterWeights`. Refused, with the reason, for other pairs and plans."""
    from layerswap.merge.adapter_merge import swap_adapters
    from layerswap.models.adapters import read_adapter

    if adapter_pair(math, lang) is None:
        raise UserError("A merge on the adapters needs two PEFT adapters of one kind (LoRA, IA3 or prefix tuning) as "
                        "experts; other pairs are merged as full models (drop --adapter).")
    base = base or Checkpoint.open(math.adapter_base)
    sources = Sources(as_recipe(recipe), math.num_layers, math.arch)
    return swap_adapters(read_adapter(math.adapter).weights(), read_adapter(lang.adapter).weights(), sources,
                         lambda name: base.get(name))


def export_adapter_merge(math: Checkpoint, lang: Checkpoint, recipe: Recipe | Plan, out: str | os.PathLike, *,
                         base: Checkpoint | None = None, overwrite: bool = False, force: bool = False,
                         protect: tuple = (), languages: list[str] | None = None) -> Path:
    """Write the swap of two adapter experts as a PEFT adapter folder of their kind (``adapter_config.json``,
    ``adapter_model.safetensors``, the tokenizer) with the model card; the base it applies to is `base` (else the
    experts' own). The same checks as `export_merge` run first. Returns the folder."""
    from layerswap.merge.adapter_merge import peft_files
    from layerswap.models.adapters import read_adapter
    from layerswap.models.tensorfile import write_tensors

    recipe = as_recipe(recipe)
    languages = check_languages(languages)
    check = check_mergeable(math, lang, base, force=force)
    check.raise_if_bad()
    merged = merged_adapter(math, lang, recipe, base)
    base_ref = base.ref if base is not None else str(read_adapter(math.adapter).base_ref or math.adapter_base)
    cfg, tensors = peft_files(merged, read_adapter(math.adapter).config, base_ref)
    out = check_output_folder(out, input_paths(math, lang, base, extra=protect), overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write_tensors(tmp / "adapter_model.safetensors", tensors)
        (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=1))
        for f in math.tokenizer_files():
            shutil.copy2(f, tmp / f.name)
        sources = Sources(recipe, math.num_layers, math.arch)
        prov = provenance(math, lang, base, sources, check.pairing, bool(check.pairing.suspicious and force), languages)
        prov["adapter"] = {"kind": merged.kind, "base": base_ref, "modules": len(merged.modules),
                           "full_copies": sorted(merged.full), "rank": cfg.get("r")}
        prov["mergekit_yaml"], prov["mergekit_unavailable"] = None, "mergekit merges full models, not PEFT adapters"
        write_card(tmp, prov)
        _atomic_replace(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _copy_side_files(math: Checkpoint, dst: Path) -> None:
    for name in ("config.json", "generation_config.json"):
        if (math.path / name).exists():
            shutil.copy2(math.path / name, dst / name)
    for f in math.tokenizer_files():
        shutil.copy2(f, dst / f.name)


def _atomic_replace(tmp: Path, out: Path, overwrite: bool) -> None:
    if out.exists():
        if not out.is_dir() or (any(out.iterdir()) and not (overwrite and (out / EXPORT_MARK).is_file())):
            raise UserError(f"{out.name} appeared while merging; nothing was written. Choose a new folder.")
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)

