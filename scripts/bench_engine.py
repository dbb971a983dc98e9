#!/usr/bin/env python3
"""Engine benchmark: live weight refresh vs a new vLLM engine, and vLLM vs transformers throughput.

    python scripts/bench_engine.py [--model DIR --model-b DIR] [--lang sw] [--mgsm-dir DIR]

Both ratios are measured in one run on one machine:

1. refresh: seconds for `VLLMEngine.refresh` (reload_weights from an exported folder + prefix-cache
   reset; median of several) against constructing a new engine on the same weights.
   Goal: refresh at least 20x faster.
2. throughput: output tokens/s of the vLLM engine and of the transformers engine on the same 250
   MGSM prompts (0-shot mgsm_native_cot, greedy, its stop words, 256 new tokens) and the same model.
   Goal: vLLM at least 5x.

3. builds (``--builds``, on its own): seconds for a Build into the running engine of the merge (`Workbench.build`
   with three vLLM engines: merge plus refresh), the engine plan's refresh ``memory`` (the merge streamed into
   the engine, nothing written) against ``disk`` (exported to a scratch folder, reloaded from it; what a GPU's
   plan does), median over alternating plans, on the demo trio (default) or the two built models; the merged
   model's answers are checked equal in both.

Without --model it builds two random Llama checkpoints of one shape (8 layers, hidden 512, head_dim
64, float32) in a temporary folder. Prints a Markdown table plus the machine and versions.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_models(root: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    from layerswap.shipped.demo import build_tokenizer, make_tiny_llama, perturb

    tok = build_tokenizer(vocab_size=768)
    a = make_tiny_llama(root / "a", layers=layers, hidden=hidden, heads=hidden // 64, intermediate=hidden * 11 // 4,
                        seed=0, tokenizer=tok)
    return a, perturb(a, root / "b", scale=0.2, seed=1)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: a random Llama built here)")
    p.add_argument("--model-b", help="second folder of the same shape for the refresh (default: a perturbed copy)")
    p.add_argument("--lang", default="sw", help="MGSM language of the 250 prompts (default sw)")
    p.add_argument("--mgsm-dir", default=os.environ.get("LAYERSWAP_MGSM_DIR"), help="folder of mgsm_XX.tsv")
    p.add_argument("--limit", type=int, help="fewer prompts (default: all 250)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512, help="hidden size of the built model")
    p.add_argument("--layers", type=int, default=8, help="layers of the built model")
    p.add_argument("--hf-batch", type=int, default=32, help="transformers engine batch size")
    p.add_argument("--refreshes", type=int, default=5)
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="vLLM KV cache on CPU (default 4)")
    p.add_argument("--device", default="auto", help="transformers device (cpu, cuda, auto)")
    p.add_argument("--builds", action="store_true", help="only measure 3: Builds in memory vs through disk")
    p.add_argument("--trio", default="assets:demo", help="--builds: folder with math/, lang/, base/ (default the "
                   "demo; 'built': the two built models)")
    args = p.parse_args(argv)
    if args.builds:
        return bench_builds(args)

    from layerswap.evaluation import mgsm
    from layerswap.engines import TransformersEngine, VLLMEngine, VLLMSettings, vllm_status
    from layerswap.evaluation.run import EvalConfig, build_prompts

    ok, why = vllm_status()
    if not ok:
        print(f"cannot benchmark: {why}", file=sys.stderr)
        return 2
    tmp = tempfile.TemporaryDirectory(prefix="layerswap-bench-")
    if args.model:
        a = Path(args.model)
        b = Path(args.model_b) if args.model_b else a
    else:
        a, b = build_models(Path(tmp.name), args.hidden, args.layers)
    cfg = EvalConfig(langs=[args.lang], limit=args.limit, source=args.mgsm_dir, max_new_tokens=args.max_new_tokens)
    prompts = [x.prompt for x in build_prompts(args.lang, cfg)]
    stop = mgsm.get_language(args.lang).stop
    n = len(prompts)
    settings = VLLMSettings(chunk_size=n, max_num_seqs=256, kv_cache_gib=args.kv_cache_gib)

    print(f"model: {a} ({'given' if args.model else f'random Llama, {args.layers} layers, hidden {args.hidden}'}); "
          f"{n} MGSM {args.lang} prompts, {args.max_new_tokens} new tokens; {why}", flush=True)

    # 1. refresh vs new engine -------------------------------------------------------------------
    eng = VLLMEngine(a, settings, use_chat_template=False)
    first_start = eng.start_seconds
    refresh = []
    for i in range(args.refreshes):
        refresh.append(eng.refresh(b if i % 2 == 0 else a))
    eng.ensure(b)
    fresh = VLLMEngine(b, settings, use_chat_template=False)  # a new engine on the weights just refreshed into `eng`
    new_engine = fresh.start_seconds
    probe = prompts[:8]
    same = eng.generate(probe, 32, stop) == fresh.generate(probe, 32, stop)
    fresh.close()
    eng.ensure(a)
    r_med = statistics.median(refresh)
    print(f"refresh median {r_med:.3f} s over {len(refresh)}; new engine {new_engine:.1f} s "
          f"(first start {first_start:.1f} s); refreshed == fresh on 8 prompts: {same}", flush=True)

    # 2. throughput on the same prompts --------------------------------------------------------
    eng.tokens_generated = 0
    t = time.perf_counter()
    v_out = eng.generate(prompts, args.max_new_tokens, stop)
    v_s = time.perf_counter() - t
    v_tok = eng.tokens_generated
    eng.close()
    print(f"vLLM: {v_tok} tokens in {v_s:.1f} s", flush=True)

    hf = TransformersEngine.from_pretrained(a, args.device, batch_size=args.hf_batch, use_chat_template=False)
    t = time.perf_counter()
    h_out = hf.generate(prompts, args.max_new_tokens, stop)
    h_s = time.perf_counter() - t
    h_tok = hf.tokens_generated
    print(f"transformers: {h_tok} tokens in {h_s:.1f} s", flush=True)
    agree = sum(x == y for x, y in zip(v_out, h_out)) / n

    v_tps, h_tps = v_tok / v_s, h_tok / h_s
    import torch
    import transformers
    import vllm

    print()
    print(f"Machine: {cpu_name()}, {os.cpu_count()} cores, {_mem_gib():.0f} GiB RAM"
          f"{', GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else ', no GPU'}; "
          f"date {dt.date.today().isoformat()}; vllm {vllm.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print()
    print("| measure | vLLM | baseline | ratio | goal |")
    print("|---|---|---|---|---|")
    print(f"| new weights into a running engine: live refresh vs new engine on the same weights (s) | "
          f"{r_med:.3f} | {new_engine:.1f} | {new_engine / r_med:.0f}x | ≥20x |")
    print(f"| output tokens/s, {n} MGSM {args.lang} prompts, greedy, ≤{args.max_new_tokens} new tokens: "
          f"vLLM vs transformers (batch {args.hf_batch}) | {v_tps:.0f} | {h_tps:.0f} | {v_tps / h_tps:.1f}x | ≥5x |")
    print()
    print(f"Identical answers, vLLM vs transformers: {agree:.0%} of {n}; tokens {v_tok} vs {h_tok}. "
          f"Refreshed engine == fresh engine: {same}.")
    tmp.cleanup()
    return 0


def bench_builds(args) -> int:
    """Measure 3: a Build in memory against a Build through disk, on one set of engines."""
    from dataclasses import replace

    import torch
    import vllm

    from layerswap import Plan
    from layerswap.models.presets import ASSETS_PREFIX, assets_path
    from layerswap.serving.workbench import Workbench

    tmp = tempfile.TemporaryDirectory(prefix="layerswap-bench-")
    if args.trio == "built":
        a, b = build_models(Path(tmp.name), args.hidden, args.layers)
        refs, what = {"math": a, "lang": b}, f"random Llama, {args.layers} layers, hidden {args.hidden}"
    else:
        root = assets_path(args.trio) if args.trio.startswith(ASSETS_PREFIX) else Path(args.trio)
        refs, what = {r: root / r for r in ("math", "lang", "base")}, args.trio
    plans = [Plan(b=1, u=1, tb=1, tu=0), Plan(b=2, u=1, tb=0, tu=1), Plan(b=1, u=2, tb=1, tu=1, transition="ramp")]
    prompts = ["Question: 2 + 3 = ?\nAnswer:", "Swali: 7 - 4 = ?\nJibu:"]
    seconds: dict[str, list[float]] = {}
    answers: dict[str, list] = {}
    nbytes = 0
    for mode in ("memory", "disk"):
        wb = Workbench(engine="vllm", serving="three")
        wb.check(str(refs["math"]), str(refs["lang"]), str(refs.get("base") or "") or None, force=True)
        wb.engine_plan = replace(wb.engine_plan, refresh=mode)
        wb.start()
        nbytes = wb.checkpoints["math"].nbytes
        wb.build(plans[-1])  # warm: the engines' first refresh, torch's first blend
        seconds[mode], answers[mode] = [], []
        for i in range(args.refreshes):
            t = time.perf_counter()
            wb.build(plans[i % len(plans)])
            seconds[mode].append(time.perf_counter() - t)
            if i < len(plans):
                answers[mode].append(wb.engines["merged"].generate(prompts, max_new_tokens=16))
        wb.close()
    mem, disk = statistics.median(seconds["memory"]), statistics.median(seconds["disk"])
    print(f"Machine: {cpu_name()}, {os.cpu_count()} cores, {_mem_gib():.0f} GiB RAM"
          f"{', GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else ', no GPU'}; "
          f"date {dt.date.today().isoformat()}; vllm {vllm.__version__}, torch {torch.__version__}; "
          f"models {what} ({nbytes / 1e6:.1f} MB each)")
    print()
    print("| measure | in memory | through disk | ratio |")
    print("|---|---|---|---|")
    print(f"| a Build into the merge's running vLLM engine (merge + refresh), median of {args.refreshes} (s) | "
          f"{mem:.4f} | {disk:.4f} | {disk / mem:.1f}x |")
    print(f"\nSame merged answers in both: {answers['memory'] == answers['disk']}; plans differ: "
          f"{len({str(a) for a in answers['memory']}) > 1}.")
    tmp.cleanup()
    return 0


def _mem_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 0.0


if __name__ == "__main__":  # vLLM spawns worker processes: the guard is required
    sys.exit(main())
