#!/usr/bin/env python3
"""Shared by the benchmarks: a Llama-shape trio (base, math expert, language expert) with random
values written straight to safetensors, tensor by tensor, built once and cached on disk.

    import sys; sys.path.insert(0, "scripts")
    from bench_common import build_trio
    paths = build_trio("/work/bench-cache")              # ~1.1B: {"base": Path, "math": Path, "lang": Path}
    paths = build_trio("/work/bench8b", size="8b")       # Llama 3.1 8B dimensions, 48 GB

    python3 scripts/bench_common.py /work/bench-cache              # build (or find) it from the shell
    python3 scripts/bench_common.py /work/bench8b --size 8b
    python3 scripts/bench_common.py /work/bench8b --size 8b --extra-langs 1   # + lang2: a family of two languages

    make_adapter(base, out, "lora", seed=1)              # a PEFT adapter of a small base (tests, gpu_check's LoRA pass)

Sizes (`SIZES`), both untied lm_head, bfloat16:

* ``1b``: TinyLlama-1.1B (22 layers, hidden 2048, intermediate 5632, 32 heads, 4 KV heads, vocab
  32000); one ``model.safetensors`` per model (2.2 GB each, 6.6 GB in all).
* ``8b``: Llama 3.1 8B (32 layers, hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab
  128256); four shards of at most 5 GB per model with ``model.safetensors.index.json``, like the
  published checkpoint (16.1 GB each, 48.2 GB in all), and a tiny byte-level BPE tokenizer so
  other tools (transformers, the app) can open the folders.

Values are deterministic: every tensor comes from its own ``torch.Generator`` seeded from the
spec's seed and the tensor's name, so two builds with one torch version are byte-identical
(`trio.json` records a checksum of sampled bytes to check that). Large tensors are generated in
row blocks (``gen_block`` elements), so building holds a few hundred MB whatever the size.

The experts are the base plus Gaussian changes whose size follows the paper's picture of real
fine-tunes: the language expert changes most in the bottom and top layers (and the embeddings /
lm_head), the math expert in the middle layers. Changes are 0.2%-2.2% of the weight scale per
entry, so in bf16 many round to zero or to a few units in the last place, like real light
fine-tunes.
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
SPEC_8B = {
    "version": 1,
    "name": "llama-8b",
    "layers": 32,
    "hidden": 4096,
    "intermediate": 14336,
    "heads": 32,
    "kv_heads": 8,
    "vocab": 128256,
    "dtype": "BF16",
    "seed": 20250108,
    "weight_std": 0.02,
    "shard_bytes": 5 * 10**9,
    "gen_block": 1 << 25,
    "rope_theta": 500000.0,
    "max_positions": 8192,
    "tokenizer": True,
}
SIZES = {"1b": SPEC, "8b": SPEC_8B}
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


def tensor_blocks(name: str, shape: tuple[int, ...], spec: dict = SPEC):
    """The tensor's flattened values in blocks of ``spec["gen_block"]`` elements (default: one block):
    yields ``{"base": bf16, "math": bf16, "lang": bf16}`` per block."""
    numel = math.prod(shape)
    step = spec.get("gen_block") or numel
    gens = {"base": _gen(spec["seed"], "base:" + name), **{r: _gen(spec["seed"], f"{r}:{name}") for r in ("math", "lang")}}
    one_d = len(shape) == 1
    for start in range(0, numel, step):
        n = min(step, numel - start)
        x = torch.randn(n, generator=gens["base"])
        base = ((1.0 + 0.02 * x) if one_d else (spec["weight_std"] * x)).to(torch.bfloat16)
        out = {"base": base}
        for r in ("math", "lang"):
            scale = change_scale(r, name, spec) * (0.02 if one_d else spec["weight_std"])
            out[r] = (base.float() + scale * torch.randn(n, generator=gens[r])).to(torch.bfloat16)
        yield out


def config(spec: dict = SPEC) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec["hidden"],
        "intermediate_size": spec["intermediate"], "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"], "num_key_value_heads": spec["kv_heads"],
        "vocab_size": spec["vocab"], "max_position_embeddings": spec.get("max_positions", 2048), "rms_norm_eps": 1e-5,
        "rope_theta": spec.get("rope_theta", 10000.0), "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
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


def shards(spec: dict = SPEC) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """(file name, tensors in file order) per shard: one ``model.safetensors``, or HF-named shards of at
    most ``spec["shard_bytes"]``."""
    limit = spec.get("shard_bytes")
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_specs(spec):
        n = math.prod(shape) * 2
        if limit and groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += n
    if len(groups) == 1:
        return [("model.safetensors", groups[0])]
    return [(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", g) for i, g in enumerate(groups)]


def expected_bytes(spec: dict = SPEC) -> int:
    """Bytes of one model's safetensors files."""
    return sum(len(_header(g)) + sum(math.prod(s) * 2 for _, s in g) for _, g in shards(spec))


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
    return Path(root) / f"{spec.get('name', 'llama-1.1b')}-trio-v{spec['version']}"


def _files_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _write_tokenizer(folder: Path) -> None:
    """A tiny byte-level BPE tokenizer (ids 0-2: <pad>, <s>, </s>, like the config), for tools that need one."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from layerswap.shipped.demo import build_tokenizer

    build_tokenizer().save_pretrained(folder)


def build_trio(root: str | os.PathLike, spec: dict | None = None, log=print, *, size: str = "1b") -> dict[str, Path]:
    """Build (or reuse) the trio of `size` (or `spec`) under ``root``; returns ``{"base", "math", "lang"}`` folders."""
    spec = spec or SIZES[size]
    out = trio_dir(root, spec)
    marker = out / "trio.json"
    paths = {r: out / r for r in ROLES}
    if marker.exists():
        info = json.loads(marker.read_text())
        ok = info.get("spec") == spec and all(paths[r].is_dir() and _files_bytes(paths[r]) == info["bytes"]
                                             for r in ROLES)
        if ok:
            return paths
        log(f"{out}: stale or incomplete, rebuilding")
    Path(root).mkdir(parents=True, exist_ok=True)
    for stale in Path(root).glob(f".{out.name}.building-*"):  # an interrupted build
        shutil.rmtree(stale, ignore_errors=True)
    need = 3 * expected_bytes(spec)
    free = shutil.disk_usage(root).free
    if free < need * 1.05:
        raise SystemExit(f"{root}: the trio needs {need / 1e9:.1f} GB of disk, only {free / 1e9:.1f} GB free.")
    tmp = Path(root) / f".{out.name}.building-{os.getpid()}"
    layout = shards(spec)
    t0 = time.perf_counter()
    for r in ROLES:
        (tmp / r).mkdir(parents=True)
        (tmp / r / "config.json").write_text(json.dumps(config(spec), indent=2))
        if spec.get("tokenizer"):
            _write_tokenizer(tmp / r)
        if len(layout) > 1:
            weight_map = {n: fname for fname, g in layout for n, _ in g}
            index = {"metadata": {"total_size": sum(math.prod(s) * 2 for _, g in layout for _, s in g)},
                     "weight_map": dict(sorted(weight_map.items()))}
            (tmp / r / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    total = sum(math.prod(s) for _, g in layout for _, s in g)
    done = 0
    last_log = t0
    for fname, group in layout:
        files = {r: open(tmp / r / fname, "wb") for r in ROLES}
        try:
            for r in ROLES:
                files[r].write(_header(group))
            for name, shape in group:
                for block in tensor_blocks(name, shape, spec):
                    for r in ROLES:
                        files[r].write(memoryview(block[r].view(torch.uint8).numpy()))
                done += math.prod(shape)
                if time.perf_counter() - last_log > 30:
                    last_log = time.perf_counter()
                    log(f"  trio: {done / total:.0%} ({name}, {last_log - t0:.0f} s)")
        finally:
            for f in files.values():
                f.flush()
                os.fsync(f.fileno())
                f.close()
    info = {"spec": spec, "bytes": expected_bytes(spec), "torch": torch.__version__,
            "checksums": {r: {f.name: _checksum(f) for f in sorted((tmp / r).glob("*.safetensors"))} for r in ROLES},
            "seconds_to_build": round(time.perf_counter() - t0, 1)}
    (tmp / "trio.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"built {out} in {info['seconds_to_build']} s")
    return paths


def extra_lang_blocks(name: str, shape: tuple[int, ...], j: int, spec: dict = SPEC):
    """Blocks of a further language expert `j` (2, 3, ...): the base of `tensor_blocks` plus changes of the
    language expert's size drawn from a generator of its own (so it differs from ``lang`` everywhere)."""
    numel = math.prod(shape)
    step = spec.get("gen_block") or numel
    gb, gl = _gen(spec["seed"], "base:" + name), _gen(spec["seed"], f"lang{j}:{name}")
    one_d = len(shape) == 1
    for start in range(0, numel, step):
        n = min(step, numel - start)
        x = torch.randn(n, generator=gb)
        base = ((1.0 + 0.02 * x) if one_d else (spec["weight_std"] * x)).to(torch.bfloat16)
        scale = change_scale("lang", name, spec) * (0.02 if one_d else spec["weight_std"])
        yield (base.float() + scale * torch.randn(n, generator=gl)).to(torch.bfloat16)


def build_extra_langs(root: str | os.PathLike, count: int, spec: dict | None = None, log=print, *,
                      size: str = "1b") -> dict[str, Path]:
    """The trio of `build_trio` plus `count` more language experts (``lang2``, ``lang3``, ... beside it,
    one model each: 16 GB at 8b); returns every role's folder, ``lang`` first among the languages."""
    spec = spec or SIZES[size]
    paths = build_trio(root, spec, log)
    out = trio_dir(root, spec)
    info = json.loads((out / "trio.json").read_text())
    for j in range(2, count + 2):
        folder = out / f"lang{j}"
        paths[f"lang{j}"] = folder
        if (folder / "done.json").exists() and _files_bytes(folder) == info["bytes"]:
            continue
        free = shutil.disk_usage(out).free
        if free < info["bytes"] * 1.05:
            raise SystemExit(f"{out}: lang{j} needs {info['bytes'] / 1e9:.1f} GB of disk, only {free / 1e9:.1f} GB free.")
        shutil.rmtree(folder, ignore_errors=True)
        tmp = out / f".lang{j}.building-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(out / "lang", tmp, ignore=shutil.ignore_patterns("*.safetensors"))
        t0 = time.perf_counter()
        for fname, group in shards(spec):
            with open(tmp / fname, "wb") as f:
                f.write(_header(group))
                for name, shape in group:
                    for block in extra_lang_blocks(name, shape, j, spec):
                        f.write(memoryview(block.view(torch.uint8).numpy()))
                f.flush()
                os.fsync(f.fileno())
        (tmp / "done.json").write_text(json.dumps({"seconds_to_build": round(time.perf_counter() - t0, 1)}))
        tmp.rename(folder)
        log(f"built {folder} in {time.perf_counter() - t0:.0f} s")
    return paths


def make_adapter(base: Path, out: Path, kind: str, seed: int, *, layers=None, full: tuple[str, ...] = (),
                 tokens: int = 4, embed: bool = False, scale: float = 0.05, rank: int = 4) -> Path:
    """A PEFT adapter of `kind` (lora, ia3, prefix) on `base`, built with peft, its weights moved off their
    identity start (seeded): LoRA of `rank` on q, v, down (and the embeddings with `embed`), IA3 on k, v, down,
    a `tokens`-token prefix; only `layers` (default all) and full copies of the modules in `full`."""
    from peft import IA3Config, LoraConfig, PrefixTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    n = model.config.num_hidden_layers
    at = rf".*\.layers\.({'|'.join(map(str, range(n) if layers is None else layers))})\."
    extra = dict(modules_to_save=list(full)) if full else {}
    if kind == "lora":
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=at + r"(self_attn\.(q|v)_proj|mlp\.down_proj)"
                         + (r"|.*embed_tokens" if embed else ""), **extra)
    elif kind == "ia3":
        cfg = IA3Config(target_modules=at + r"(self_attn\.(k|v)_proj|mlp\.down_proj)",
                        feedforward_modules=at + r"mlp\.down_proj", **extra)
    else:
        cfg = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=tokens, **extra)
    pm = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
            elif "ia3_l" in name:
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)
            elif "prompt_encoder" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    pm.save_pretrained(out)
    return out


def drop_page_cache(paths) -> None:
    """Ask the kernel to forget the cached pages of these files (unprivileged: posix_fadvise)."""
    for p in paths:
        for f in Path(p).rglob("*.safetensors") if Path(p).is_dir() else [Path(p)]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Build (or find) the benchmark trio.")
    ap.add_argument("root", nargs="?", default=None, help="folder (default: /work/bench-cache, or /work/bench8b for 8b)")
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--extra-langs", type=int, default=0, help="further language experts beside the trio")
    args = ap.parse_args()
    root = args.root or ("/work/bench8b" if args.size == "8b" else "/work/bench-cache")
    for role, p in build_extra_langs(root, args.extra_langs, size=args.size).items():
        print(role, p)


if __name__ == "__main__":
    main()
