#!/usr/bin/env python3
"""The GPU path, checked on the first GPU at hand: merge, analysis and generation on CUDA against the CPU.

    python3 scripts/gpu_check.py                          # a CUDA machine: every check, an 8B-shaped merge in memory
    python3 scripts/gpu_check.py --disk-8b                # also an 8B trio on disk (48 GB): analysis and export on CUDA
    python3 scripts/gpu_check.py --device cpu --shape tiny   # the same code on CPU (the test suite runs this)
    python3 scripts/gpu_check.py --vllm                   # also the engine plan and vLLM on this GPU (pip install vllm)

Needs only torch, transformers (with its own dependencies: numpy, tokenizers, pyyaml,
huggingface_hub) and this repository: no vLLM, Gradio, plotly, numba or network. It builds its
own checkpoints under ``--workdir`` (default: a temporary folder, removed at the end) with
`bench_common` (random bf16 Llama weights, experts with layer-localised changes, a tiny tokenizer):

1. merge: `export_merge` of a layer-swap plan, a ramp plan and a soup on the device and on the
   CPU; every safetensors file must be byte-identical.
2. analysis: `analyze` on the device and on the CPU. Tolerance: top-k% thresholds identical, top-k%
   shares and overlaps within 1e-9 (exact counts on both), relative change, mean |Δ| and cosine
   within 1e-5 relative (float32 products per slice, summed in float64, slices of different sizes).
3. in-memory merge at ``--shape`` (default 8b on a GPU of 40 GB or more: Llama 3.1 8B dimensions,
   random bf16 experts made on the device): seconds for the layer-swap plan (only the transition
   layers are computed) and for a soup (every tensor blended), median of 3.
4. generation: transformers, greedy, the small merged model from the export on the device and the
   CPU (same tokens?), and the in-memory merged model of step 3 on the device (tokens/s).

With ``--vllm`` (`gpu_check_vllm`): the hardware as `layerswap.core.hardware` reads it, the engine plan for an 8B trio
on it, then the planned vLLM engines started at the small shape (and at 8B with ``--disk-8b``), their answers
against transformers, a refresh from an exported merge, and the seconds of a start, a refresh and the switches of
one question. Without it, vLLM is never imported.

Prints a markdown table for docs/benchmarks.md; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import datetime as dt
import filecmp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from bench_common import SPEC_8B, build_trio, config, tensor_specs  # noqa: E402

NOT_NEEDED = ("gradio", "plotly", "kaleido", "vllm", "numba", "mergekit")
SHAPES = {
    "tiny": dict(SPEC_8B, name="gpucheck-tiny", layers=6, hidden=64, intermediate=128, heads=2, kv_heads=1, vocab=600,
                 shard_bytes=100_000, gen_block=1 << 16),
    "small": dict(SPEC_8B, name="gpucheck-small", layers=8, hidden=512, intermediate=1408, heads=8, kv_heads=4,
                  vocab=4096, shard_bytes=20_000_000, gen_block=1 << 20),
    "8b": SPEC_8B,
}
SWAP = dict(b=1, u=1, tb=1, tu=1)


class Report:
    """The rows of the table, and whether every check passed."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []
        self.ok = True

    def add(self, check: str, result: str, detail: str = "", ok: bool = True) -> None:
        self.rows.append((check, result, detail))
        self.ok &= ok
        print(f"{'ok ' if ok else 'FAIL'} {check}: {result} {detail}", flush=True)

    def markdown(self) -> str:
        lines = ["| check | result | detail |", "|---|---|---|"]
        lines += [f"| {c} | {r} | {d} |" for c, r, d in self.rows]
        return "\n".join(lines)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check_merge(trio: dict[str, Path], device: str, work: Path, rep: Report) -> Path:
    """Export three recipes on `device` and on the CPU; returns the CPU layer-swap output."""
    from layerswap import Checkpoint, MethodConfig, Plan, Recipe, export_merge

    cks = {r: Checkpoint.open(p) for r, p in trio.items()}
    recipes = {"layer swap": Recipe(plan=Plan(**SWAP)),
               "ramp": Recipe(plan=Plan(b=1, u=1, tb=2, tu=1, transition="ramp")),
               "soup": Recipe(MethodConfig("soup", weight=0.35))}
    first = None
    for label, recipe in recipes.items():
        outs, secs = {}, {}
        for dev in dict.fromkeys(["cpu", device]):
            out = work / f"merge-{label.replace(' ', '-')}-{dev.replace(':', '')}"
            t = time.perf_counter()
            export_merge(cks["math"], cks["lang"], recipe, out, base=cks["base"], device=dev)
            secs[dev] = time.perf_counter() - t
            outs[dev] = out
        files = sorted(p.name for p in outs["cpu"].glob("*.safetensors"))
        same = all(filecmp.cmp(outs["cpu"] / f, outs[device] / f, shallow=False) for f in files)
        size = sum((outs["cpu"] / f).stat().st_size for f in files)
        rep.add(f"merge on {device} = CPU, byte for byte ({label})", "identical" if same else "DIFFERENT",
                f"files: {len(files)}, {size / 1e6:.1f} MB; {secs[device]:.2f} s on {device}, {secs['cpu']:.2f} s on cpu",
                ok=same)
        first = first or outs["cpu"]
    return first


def check_analysis(trio: dict[str, Path], device: str, rep: Report) -> None:
    import numpy as np

    from layerswap import Checkpoint
    from layerswap.analysis import analyze

    cks = {r: Checkpoint.open(p) for r, p in trio.items()}
    an = {}
    secs = {}
    for dev in dict.fromkeys(["cpu", device]):
        t = time.perf_counter()
        an[dev] = analyze(cks["base"], cks["math"], cks["lang"], ks=(1.0, 10.0), device=dev, cache=False)
        secs[dev] = time.perf_counter() - t
    a, b = an["cpu"], an[device]
    worst_rel = 0.0
    for panel, metric in (("math", "relative"), ("lang", "relative"), ("math", "mean_abs"), ("lang", "mean_abs"),
                          ("overlap", "cosine"), ("math-lang", "relative")):
        x, y = a.values(panel, metric), b.values(panel, metric)
        ok = np.isfinite(x) & np.isfinite(y)
        worst_rel = max(worst_rel, float(np.max(np.abs(x[ok] - y[ok]) / np.maximum(np.abs(x[ok]), 1e-30), initial=0)))
    worst_share, same_thr = 0.0, True
    for k in (1.0, 10.0):
        ta, tb = a.topk_at(k), b.topk_at(k)
        same_thr &= ta.threshold == tb.threshold
        for arr_a, arr_b in ((ta.share("math"), tb.share("math")), (ta.share("lang"), tb.share("lang")),
                             (ta.joint / ta.K, tb.joint / tb.K)):
            worst_share = max(worst_share, float(np.max(np.abs(arr_a - arr_b))))
    ok = same_thr and worst_share <= 1e-9 and worst_rel <= 1e-5
    rep.add(f"analysis on {device} = CPU within tolerance", "within" if ok else "OUTSIDE",
            f"thresholds {'identical' if same_thr else 'DIFFER'}; top-k shares/overlap max diff {worst_share:.1e} "
            f"(≤1e-9); relative, mean abs, cosine max rel diff {worst_rel:.1e} (≤1e-5); {secs[device]:.2f} s on "
            f"{device}, {secs['cpu']:.2f} s on cpu ({a.N / 1e6:.1f}M entries per model)", ok=ok)


def random_experts(spec: dict, device: str) -> tuple[dict, dict]:
    g = torch.Generator(device=device).manual_seed(0)
    math, lang = {}, {}
    for name, shape in tensor_specs(spec):
        base = 0.02 * torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        math[name] = base + 4e-4 * torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        lang[name] = base + 4e-4 * torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        del base
    return math, lang


def check_in_memory(spec: dict, shape: str, device: str, rep: Report):
    """Merge times of an in-memory model on `device`; returns the layer-swapped state dict."""
    from layerswap import MethodConfig, Plan, Recipe, merge_in_memory

    t = time.perf_counter()
    math, lang = random_experts(spec, device)
    sync(device)
    made = time.perf_counter() - t
    n = sum(v.numel() for v in math.values())
    L = spec["layers"]
    merged = None
    for label, recipe in (("layer swap b=1 u=1 tb=1 tu=1", Recipe(plan=Plan(**SWAP))),
                          ("soup (every tensor blended)", Recipe(MethodConfig("soup", weight=0.35)))):
        times = []
        for _ in range(3):
            sync(device)
            t = time.perf_counter()
            out = merge_in_memory(math, lang, L, recipe)
            sync(device)
            times.append(time.perf_counter() - t)
            if merged is None and label.startswith("layer"):
                merged = out
            del out
        blended = sum(1 for k in merged if merged[k] is not math[k] and merged[k] is not lang[k]) \
            if label.startswith("layer") else len(math)
        rep.add(f"in-memory merge, {shape} shape ({n / 1e6:,.0f}M parameters, bf16) on {device}: {label}",
                f"{statistics.median(times):.3f} s", f"median of 3; {blended} of {len(math)} tensors computed; "
                f"experts made on the device in {made:.1f} s")
    del math, lang
    return merged


def generate(model, tok, device: str, new_tokens: int) -> tuple[list[int], float]:
    ids = tok("Question: Roger has 5 tennis balls. Answer:", return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
        sync(device)
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        sync(device)
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - t


def check_generation(merged_dir: Path, device: str, rep: Report, new_tokens: int = 32) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(merged_dir)
    got = {}
    for dev in dict.fromkeys(["cpu", device]):
        model = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).to(dev).eval()
        got[dev] = generate(model, tok, dev, new_tokens)
        del model
    same = got["cpu"][0] == got[device][0]
    first = next((i for i, (x, y) in enumerate(zip(got["cpu"][0], got[device][0])) if x != y), None)
    rep.add(f"transformers generation, small merged model (float32) on {device}",
            f"{new_tokens / got[device][1]:.0f} tokens/s",
            f"greedy, {new_tokens} new tokens; same tokens as the CPU: "
            f"{'yes' if same else f'no (from token {first}; float32 sums in another order)'}")


def check_big_generation(merged: dict, spec: dict, shape: str, tok_dir: Path, device: str, rep: Report,
                         new_tokens: int = 32) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.for_model(**config(spec))
    t = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.load_state_dict(merged, assign=True)
    model.eval()
    sync(device)
    load = time.perf_counter() - t
    tok = AutoTokenizer.from_pretrained(tok_dir)
    _, secs = generate(model, tok, device, new_tokens)
    rep.add(f"transformers generation, {shape}-shaped merged model (bf16, from memory) on {device}",
            f"{new_tokens / secs:.1f} tokens/s", f"greedy, batch 1, {new_tokens} new tokens; model built and "
            f"weights assigned in {load:.1f} s")


def check_disk_8b(work: Path, device: str, rep: Report) -> None:
    """The 8B trio on disk: analysis and a layer-swap export on the device."""
    from layerswap import Checkpoint, Plan, Recipe, export_merge
    from layerswap.analysis import analyze

    model = 16.1e9
    free = shutil.disk_usage(work).free
    if free < 3.2 * model:
        rep.add("8B on disk", "skipped", f"the trio needs {3.2 * model / 1e9:.0f} GB free under {work}, "
                f"{free / 1e9:.0f} GB are")
        return
    t = time.perf_counter()
    trio = build_trio(work, size="8b", log=lambda *_: None)
    rep.add("8B trio built on disk", f"{time.perf_counter() - t:.0f} s", "3 x 16.1 GB, bf16 (bench_common --size 8b)")
    cks = {r: Checkpoint.open(p) for r, p in trio.items()}
    t = time.perf_counter()
    an = analyze(cks["base"], cks["math"], cks["lang"], device=device, cache=False)
    rep.add(f"8B analysis on {device} (files in the page cache as far as they fit)",
            f"{time.perf_counter() - t:.1f} s", f"{an.run.bytes_read / 1e9:.1f} GB read, {an.run.passes} pass(es)")
    if shutil.disk_usage(work).free < 1.05 * model:
        rep.add(f"8B export merge on {device}", "skipped", f"no room for a 16 GB output under {work}")
        return
    t = time.perf_counter()
    export_merge(cks["math"], cks["lang"], Recipe(plan=Plan(b=5, u=2, tb=1, tu=1)), work / "merged-8b",
                 base=cks["base"], device=device)
    rep.add(f"8B export merge b=5 u=2 tb=1 tu=1 on {device}", f"{time.perf_counter() - t:.1f} s", "16.1 GB written")
    shutil.rmtree(work / "merged-8b", ignore_errors=True)


def check_big(spec: dict, shape: str, tok_dir: Path, device: str, rep: Report, new_tokens: int) -> None:
    """The in-memory merge at `shape`, then generation from it; its tensors freed before anything else runs."""
    merged = check_in_memory(spec, shape, device, rep)
    check_big_generation(merged, spec, shape, tok_dir, device, rep, new_tokens)


def guarded(rep: Report, what: str, device: str, fn, *args, **kw):
    """`fn`'s result, or None with a failed row saying why; the CUDA cache emptied afterwards either way (an 8B
    merge leaves tens of GiB in torch's cache that vLLM's engines would otherwise not find free)."""
    import gc

    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - any failure is a row of the report
        rep.add(what, "FAILED", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", ok=False)
        return None
    finally:
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu to run the same code on the CPU")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="in-memory merge and generation shape (default: 8b on a GPU of 40 GB or more, else small)")
    ap.add_argument("--workdir", default=None, help="where checkpoints are built (default: a temporary folder)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated per generation check (default 32)")
    ap.add_argument("--disk-8b", action="store_true", help="also build the 8B trio on disk (48 GB) and time the "
                                                           "analysis and an export on the device (and, with --vllm, "
                                                           "serve it)")
    ap.add_argument("--vllm", action="store_true", help="also plan the engines on this machine and check the planned "
                                                        "vLLM engines against transformers (needs vLLM)")
    args = ap.parse_args()
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("torch sees no CUDA GPU here; run with --device cpu to check the same code on the CPU.")
        return 2
    gpu_mem = torch.cuda.get_device_properties(device).total_memory if device.startswith("cuda") else 0
    shape = args.shape or ("8b" if gpu_mem >= 40 * 2**30 else "small")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="layerswap-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    import transformers

    started = dt.datetime.now().astimezone().isoformat(timespec="minutes")
    where = (f"{torch.cuda.get_device_name(device)} ({gpu_mem / 2**30:.0f} GiB)" if gpu_mem else "no GPU (cpu run)")
    rep = Report()
    try:
        small = SHAPES["tiny" if shape == "tiny" else "small"]
        trio = build_trio(work, spec=small, log=lambda *_: None)
        merged_dir = guarded(rep, "merge", device, check_merge, trio, device, work, rep)
        guarded(rep, "analysis", device, check_analysis, trio, device, rep)
        if merged_dir is not None:
            guarded(rep, "transformers generation", device, check_generation, merged_dir, device, rep, args.new_tokens)
        guarded(rep, f"in-memory merge and generation, {shape} shape", device, check_big, SHAPES[shape], shape,
                trio["math"], device, rep, args.new_tokens)
        if args.disk_8b:
            guarded(rep, "8B on disk", device, check_disk_8b, work, device, rep)
        if args.vllm:
            from gpu_check_vllm import check_vllm

            guarded(rep, "vLLM", device, check_vllm, work, device, SHAPES["small"], rep, args.new_tokens,
                    disk_8b=args.disk_8b)
    except Exception as e:  # noqa: BLE001 - the table is printed whatever failed
        rep.add("gpu check", "FAILED", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", ok=False)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    not_needed = tuple(m for m in NOT_NEEDED if not (args.vllm and m == "vllm"))
    loaded = sorted(m for m in not_needed if sys.modules.get(m) is not None)
    rep.add("imports", "none of " + ", ".join(not_needed) if not loaded else "LOADED " + ", ".join(loaded),
            "the check needs torch, transformers and layerswap's own code only", ok=not loaded)
    print()
    print(f"Run {started} on {where}; {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores; "
          f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}; "
          f"python {platform.python_version()}.")
    print()
    print(rep.markdown())
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
