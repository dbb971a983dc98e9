"""Merging: the blend itself, in-memory merges, and streaming export to an HF-format folder.

Every output tensor gets a weight ``w`` from the plan. ``w == 0`` and ``w == 1`` copy the math
or language expert's tensor exactly (in memory: the same tensor object; on disk: the same
bytes, no dtype round trip). Anything in between is computed in float32 as
``(1-w)*math + w*lang`` and cast back to the checkpoint dtype.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from . import __version__
from .checkpoints import DTYPES, Checkpoint, TensorInfo, check_compatible
from .errors import UserError
from .plans import Plan, source_label

ProgressFn = Callable[[float, str], None]
DEFAULT_SHARD_BYTES = 5 * 10**9


def blend(math: torch.Tensor, lang: torch.Tensor, w: float) -> torch.Tensor:
    """``(1-w)*math + w*lang`` in float32, cast to math's dtype; w=0/1 return the input itself."""
    if w == 0.0:
        return math
    if w == 1.0:
        return lang
    w_lang = torch.tensor(w, dtype=torch.float32, device=math.device)
    w_math = torch.tensor(1.0 - w, dtype=torch.float32, device=math.device)
    # two separate products then a sum (no fused multiply-add), so CPU and GPU agree bit for bit
    out = torch.mul(math.to(torch.float32), w_math)
    out = out.add_(torch.mul(lang.to(torch.float32), w_lang))
    return out.to(math.dtype)


def tensor_weights(ck: Checkpoint, plan: Plan) -> dict[str, float]:
    """The plan's ``w_lang`` for every tensor of `ck`, by the tensor's layer and type."""
    lw = plan.layer_weights(ck.num_layers)
    return {n: plan.tensor_weight(t.layer, t.ptype, lw) for n, t in ck.tensors.items()}


def weights_for_names(names: list[str], num_layers: int, plan: Plan) -> dict[str, float]:
    """Same as `tensor_weights` for a plain list of names (e.g. a loaded model's state dict)."""
    from .checkpoints import classify

    lw = plan.layer_weights(num_layers)
    return {n: plan.tensor_weight(*classify(n, num_layers), lw) for n in names}


def merge_state_dicts(math: Mapping[str, torch.Tensor], lang: Mapping[str, torch.Tensor],
                      weights: Mapping[str, float], device: str | None = None) -> dict[str, torch.Tensor]:
    """Merge two state dicts in memory. Tensors with w in {0, 1} are shared, not copied."""
    out = {}
    for name, w in weights.items():
        a, b = math[name], lang[name]
        if device is not None and w not in (0.0, 1.0):
            a, b = a.to(device), b.to(device)
        out[name] = blend(a, b, w)
    return out


@dataclass
class MergeSummary:
    out: Path
    n_tensors: int
    n_copied: int
    n_blended: int
    bytes_written: int
    shards: int
    layer_weights: list[float]


def export_merge(math: Checkpoint, lang: Checkpoint, plan: Plan, out: str | os.PathLike, *,
                 base: Checkpoint | None = None, device: str = "cpu",
                 shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                 progress: ProgressFn | None = None) -> MergeSummary:
    """Stream the merge to an HF folder: config, tokenizer, safetensors shards, model card.

    Memory stays at about one tensor (plus the OS page cache). Output is written to a temporary
    sibling folder and renamed into place, so a failure leaves nothing half-written.
    """
    out = Path(out).expanduser()
    check_compatible(math, lang, base).raise_if_bad()
    plan.validate(math.num_layers)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but no CUDA GPU is visible to torch; use --device cpu.")
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists; choose a new folder or pass --overwrite.")
    weights = tensor_weights(math, plan)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        shards = _plan_shards([math.tensors[n] for n in math.tensors], shard_bytes)
        total = sum(t.nbytes for t in math.tensors.values())
        done = 0
        names_to_file: dict[str, str] = {}
        for i, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            with open(tmp / fname, "wb") as f:
                _write_header(f, shard)
                for info in shard:
                    w = weights[info.name]
                    if w in (0.0, 1.0):
                        src = math.tensors[info.name] if w == 0.0 else lang.tensors[info.name]
                        _copy_bytes(src, f)
                    else:
                        t = blend(math.get(info.name, device), lang.get(info.name, device), w)
                        f.write(_tensor_bytes(t))
                    names_to_file[info.name] = fname
                    done += info.nbytes
                    if progress:
                        progress(done / total, f"{info.name} ({source_label(w)})")
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(names_to_file.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        _copy_side_files(math, tmp)
        lw = plan.layer_weights(math.num_layers)
        provenance = {
            "layerswap_version": __version__,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "method": "layer_swap",
            "plan": plan.to_dict(),
            "layer_weights_lang": lw,
            "non_layer_weights_lang": {
                n: w for n, w in weights.items() if math.tensors[n].layer is None
            },
            "sources": {"math": math.ref, "lang": lang.ref, **({"base": base.ref} if base else {})},
            "fingerprints": {"math": math.fingerprint(), "lang": lang.fingerprint()},
        }
        (tmp / "layerswap.json").write_text(json.dumps(provenance, indent=2))
        (tmp / "README.md").write_text(model_card(math, lang, plan, lw, provenance))
        _atomic_replace(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n_copied = sum(1 for w in weights.values() if w in (0.0, 1.0))
    return MergeSummary(out, len(weights), n_copied, len(weights) - n_copied, total, len(shards), lw)


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
    return [sorted(s, key=lambda t: -DTYPES[t.dtype][1]) for s in shards]


def _write_header(f, shard: list[TensorInfo]) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)


def _copy_bytes(info: TensorInfo, dst) -> None:
    """Copy a tensor's raw bytes from its safetensors file into `dst` (kernel-side when possible)."""
    dst.flush()
    with open(info.file, "rb") as src:
        offset, remaining = info.start, info.nbytes
        out_fd = dst.fileno()
        try:
            while remaining:
                n = os.copy_file_range(src.fileno(), out_fd, remaining, offset)
                if n == 0:
                    break
                offset += n
                remaining -= n
        except (AttributeError, OSError):
            pass
        src.seek(offset)
        while remaining:
            chunk = src.read(min(remaining, 64 * 2**20))
            if not chunk:
                raise UserError(f"{info.file} ended early while copying {info.name}: the file is truncated.")
            dst.write(chunk)
            remaining -= len(chunk)
    # copy_file_range advanced the fd offset without telling the Python file object
    dst.seek(0, os.SEEK_END)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def _copy_side_files(math: Checkpoint, dst: Path) -> None:
    for name in ("config.json", "generation_config.json"):
        if (math.path / name).exists():
            shutil.copy2(math.path / name, dst / name)
    for f in math.tokenizer_files():
        shutil.copy2(f, dst / f.name)


def _atomic_replace(tmp: Path, out: Path, overwrite: bool) -> None:
    if out.exists():
        if not overwrite and (not out.is_dir() or any(out.iterdir())):
            raise UserError(f"{out} appeared while merging; nothing was written. Choose a new folder.")
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def model_card(math: Checkpoint, lang: Checkpoint, plan: Plan, lw: list[float], provenance: dict) -> str:
    rows = "\n".join(f"| {i} | {w:.4g} | {source_label(w)} |" for i, w in enumerate(lw))
    nl = "\n".join(f"| `{n}` | {w:.4g} |" for n, w in provenance["non_layer_weights_lang"].items())
    return f"""---
library_name: transformers
tags:
- merge
- layer-swapping
- layerswap
base_model:
- {math.ref}
- {lang.ref}
---

# Layer-swapped merge

Built with [layerswap](https://github.com/layerswap/layerswap) {provenance['layerswap_version']} on {provenance['created']}
by layer swapping (Bandarkar et al., "Layer Swapping for Zero-Shot Cross-Lingual Transfer in
Large Language Models", ICLR 2025).

- **Math expert** (kept in the middle): `{math.ref}`
- **Language expert** (swapped into the outer layers): `{lang.ref}`
- **Plan**: b={plan.b}, u={plan.u}, tb={plan.tb}, tu={plan.tu}, transition={plan.transition}
  (weight {plan.transition_weight}), non-layer tensors: {plan.non_layer}

Each tensor is `w*lang + (1-w)*math`, computed in float32 and cast back to the checkpoint
dtype; w = 0 or 1 copies the expert's tensor byte for byte.

{plan.describe(len(lw))}

| layer | w (language) | source |
|---|---|---|
{rows}

| non-layer tensor | w (language) |
|---|---|
{nl}

The tokenizer and config are the math expert's. This model has not been evaluated by the
merge itself: run `layerswap eval` on it before drawing conclusions.
"""
