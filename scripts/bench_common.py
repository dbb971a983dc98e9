#!/usr/bin/env python3
"""Shared by the benchmarks: a ~1.1B-parameter Llama-shape trio (base, math expert, language
expert) with random values written straight to safetensors, built once and cached on disk.

    import sys; sys.path.insert(0, "scripts")
    from bench_common import build_trio
    paths = build_trio("/work/bench-cache")       # {"base": Path, "math": Path, "lang": Path}

    python3 scripts/bench_common.py /work/bench-cache     # build (or find) it from the shell

Shape: TinyLlama-1.1B (22 layers, hidden 2048, intermediate 5632, 32 heads, 4 KV heads, vocab
32000, untied lm_head), bfloat16, one ``model.safetensors`` per model (2.2 GB each, 6.6 GB in
all). Values are deterministic: every tensor comes from its own ``torch.Generator`` seeded from
the spec's seed and the tensor's name, so two builds with one torch version are byte-identical
(`trio.json` records a checksum of sampled bytes to check that).

The experts are the base plus Gaussian changes whose size follows the paper's picture: the
language expert changes most in the bottom and top layers (and the embeddings / lm_head), the
math expert in the middle layers. Changes are 0.2%-2.2% of the weight scale per entry, so in
bf16 many round to zero or to a few units in the last place, like real light fine-tunes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import sys
import time
import zlib
from pathlib import Path

import torch

SPEC = {
    "version": 1,
    "layers": 22,
    "hidden": 2048,
    "intermediate": 5632,
    "heads": 32,
    "kv_heads": 4,
    "vocab": 32000,
    "dtype": "BF16",
    "seed": 20250101,
    "weight_std": 0.02,
}
ROLES = ("base", "math", "lang")


def tensor_specs(spec: dict = SPEC) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes in Hugging Face Llama order."""
    h, i, L = spec["hidden"], spec["intermediate"], spec["layers"]
    kv = h // spec["heads"] * spec["kv_heads"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (spec["vocab"], h))]
    for layer in range(L):
        p = f"model.layers.{layer}."
        out += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (spec["vocab"], h))]
    return out


def change_scale(role: str, name: str, spec: dict = SPEC) -> float:
    """Per-entry std of an expert's change, relative to the weight scale."""
    L = spec["layers"]
    if ".layers." in name:
        layer = int(name.split(".layers.")[1].split(".")[0])
        if role == "lang":
            return 0.002 + 0.02 * max(math.exp(-layer / 2.0), math.exp(-(L - 1 - layer) / 1.5))
        return 0.002 + 0.015 * math.exp(-(((layer - (L - 1) / 2) / (L / 5)) ** 2))
    if "norm" in name:
        return 0.002
    return 0.012 if role == "lang" else 0.002  # embeddings and lm_head: the language expert moves them


def _gen(seed: int, key: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed ^ zlib.crc32(key.encode()))


def base_tensor(name: str, shape: tuple[int, ...], spec: dict = SPEC) -> torch.Tensor:
    g = _gen(spec["seed"], "base:" + name)
    if len(shape) == 1:  # norms around 1
        return (1.0 + 0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    return (spec["weight_std"] * torch.randn(shape, generator=g)).to(torch.bfloat16)


def expert_tensor(role: str, name: str, base: torch.Tensor, spec: dict = SPEC) -> torch.Tensor:
    g = _gen(spec["seed"], f"{role}:{name}")
    scale = change_scale(role, name, spec) * (0.02 if base.dim() == 1 else spec["weight_std"])
    return (base.float() + scale * torch.randn(base.shape, generator=g)).to(torch.bfloat16)


def config(spec: dict = SPEC) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec["hidden"],
        "intermediate_size": spec["intermediate"], "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"], "num_key_value_heads": spec["kv_heads"],
        "vocab_size": spec["vocab"], "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }


def _header(specs: list[tuple[str, tuple[int, ...]]]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape in specs:
        n = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def expected_bytes(spec: dict = SPEC) -> int:
    return len(_header(tensor_specs(spec))) + sum(math.prod(s) * 2 for _, s in tensor_specs(spec))


def _checksum(path: Path) -> str:
    """sha256 of 64 KiB taken at 16 evenly spaced offsets (cheap, catches partial or foreign files)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for j in range(16):
            f.seek(size * j // 16)
            h.update(f.read(65536))
    return h.hexdigest()[:16]


def trio_dir(root: str | os.PathLike, spec: dict = SPEC) -> Path:
    return Path(root) / f"llama-1.1b-trio-v{spec['version']}"


def build_trio(root: str | os.PathLike, spec: dict = SPEC, log=print) -> dict[str, Path]:
    """Build (or reuse) the trio under ``root``; returns ``{"base", "math", "lang"}`` folders."""
    out = trio_dir(root, spec)
    marker = out / "trio.json"
    paths = {r: out / r for r in ROLES}
    if marker.exists():
        info = json.loads(marker.read_text())
        ok = info.get("spec") == spec and all(
            (paths[r] / "model.safetensors").exists()
            and (paths[r] / "model.safetensors").stat().st_size == info["bytes"] for r in ROLES)
        if ok:
            return paths
        log(f"{out}: stale or incomplete, rebuilding")
    Path(root).mkdir(parents=True, exist_ok=True)
    need = 3 * expected_bytes(spec)
    free = shutil.disk_usage(root).free
    if free < need * 1.05:
        raise SystemExit(f"{root}: the trio needs {need / 1e9:.1f} GB of disk, only {free / 1e9:.1f} GB free.")
    tmp = Path(root) / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    specs = tensor_specs(spec)
    t0 = time.perf_counter()
    files = {}
    for r in ROLES:
        (tmp / r).mkdir(parents=True)
        (tmp / r / "config.json").write_text(json.dumps(config(spec), indent=2))
        files[r] = open(tmp / r / "model.safetensors", "wb")
        files[r].write(_header(specs))
    try:
        for j, (name, shape) in enumerate(specs):
            b = base_tensor(name, shape, spec)
            files["base"].write(memoryview(b.view(torch.uint8).reshape(-1).numpy()))
            for r in ("math", "lang"):
                e = expert_tensor(r, name, b, spec)
                files[r].write(memoryview(e.view(torch.uint8).reshape(-1).numpy()))
            if j % 20 == 0:
                log(f"  trio: {j + 1}/{len(specs)} tensors ({time.perf_counter() - t0:.0f} s)")
    finally:
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
    info = {"spec": spec, "bytes": expected_bytes(spec), "torch": torch.__version__,
            "checksums": {r: _checksum(tmp / r / "model.safetensors") for r in ROLES},
            "seconds_to_build": round(time.perf_counter() - t0, 1)}
    (tmp / "trio.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"built {out} in {info['seconds_to_build']} s")
    return paths


def drop_page_cache(paths) -> None:
    """Ask the kernel to forget the cached pages of these files (unprivileged: posix_fadvise)."""
    for p in paths:
        for f in Path(p).rglob("*.safetensors") if Path(p).is_dir() else [Path(p)]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


if __name__ == "__main__":
    root = sys.argv[1] if len(sys.argv) > 1 else "/work/bench-cache"
    for role, p in build_trio(root).items():
        print(role, p)
