"""`scripts/gpu_check.py --vllm`: the engine plan and vLLM on the machine's own GPU (or, with ``--device cpu``, the
CPU build), checked end to end.

1. hardware: what `layerswap.core.hardware` reads on this machine (GPUs, memory, RAM, disk), and the engine plan for
   an 8B-shaped trio on it (headers only) beside the plan for the Hub's flavours of the same size.
2. one pass per vLLM arrangement (`PASSES`: three engines, two, one swapped, and LoRA: the experts as LoRA adapters
   of the base, peft's, on one engine) at a small shape (random bf16 experts with real weights, head size 64),
   serving forced to it: `Workbench.load` with vLLM starts exactly the plan's
   arrangement (the engine line says so); every model's greedy answer is compared with transformers on the same
   folder (tokens equal up to the first bf16 tie); a merge is built into the running engine (a refresh), exported
   and answered again against transformers on the exported folder; a question's swaps are timed; then a family's
   language switch (`Workbench.switch_lang`: a second language expert into the running engines, reloaded in its own
   engine or swapped into a shared one), after which it, the untouched math expert and a merge with it answer as
   transformers does on their folders. On a GPU the plan
   puts models that take turns in sleep mode where host RAM allows it, and the row says so. Every pass runs on
   vLLM's CPU build too (`passes_for`; CI runs ``--vllm --device cpu``): the same code, wrapped engines
   (`SwappedEngine`, `TurnEngine`) unwrapped the same way. Each pass is isolated: a failure is a row with its
   reason, and its engines are shut down and the CUDA cache emptied before the next.
3. with ``--disk-8b``: the three-engine pass at the 8B shape (48 GB of disk), so the plan's sizes meet the card's
   real memory.

Each row goes into the report table that `gpu_check.py` prints for docs/benchmarks.md.
"""

from __future__ import annotations

import gc
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

@dataclass(frozen=True)
class Pass:
    """One arrangement checked end to end: serving forced to `serving`, which must start `arrangement`."""

    serving: str
    arrangement: str
    needs_cuda: str = ""  # why it cannot run on vLLM's CPU build ("": it can)
    adapters: bool = False  # the experts are LoRA adapters of the trio's base (`_lora_trio`), not full models

    @property
    def name(self) -> str:
        return "lora" if self.adapters else self.serving


PASSES = (Pass("three", "three_vllm"), Pass("two", "two_vllm"), Pass("one", "one_vllm_swapped"),
          Pass("auto", "lora_vllm", adapters=True))


def passes_for(device: str) -> list[Pass]:
    """The passes run on `device`: every one on a GPU; on the CPU every one that does not need CUDA."""
    return [p for p in PASSES if device != "cpu" or not p.needs_cuda]


PROMPTS = ["Question: Roger has 5 tennis balls. He buys 2 more cans of 3. How many does he have? Answer:",
           "Question: A baker made 24 rolls and sold 9. How many are left? Answer:"]


def check_vllm(work: Path, device: str, shape_spec: dict, rep, new_tokens: int = 24, disk_8b: bool = False) -> None:
    from layerswap.core import hardware
    from layerswap.models.checkpoints import Checkpoint
    from layerswap.engines import plan_engines, vllm_status

    hw = hardware.current()
    gpus = ", ".join(f"{g.name or 'GPU'} {g.total / 2**30:.1f} GiB ({g.free / 2**30:.1f} free)" for g in hw.gpus)
    rep.add("hardware read by layerswap.core.hardware", gpus or "no GPU", f"RAM {hw.ram_available / 2**30:.0f} of "
            f"{hw.ram_total / 2**30:.0f} GiB available, scratch disk {hw.disk_free / 1e9:.0f} GB free, {hw.cpus} CPUs",
            ok=(device == "cpu") or bool(hw.gpus))
    eight = _sparse_8b(work / "sparse-8b")
    plan = plan_engines({r: Checkpoint.open(eight / r) for r in ("math", "lang")}, engine="vllm")
    rep.add("engine plan for an 8B trio on this machine", plan.arrangement if plan.fits else "none",
            plan.describe().replace("**", "").replace("|", "/")[:400])
    ok, why = vllm_status()
    if not ok:
        rep.add("vLLM", "NOT INSTALLED", f"{why}; the engine checks need it", ok=False)
        return
    from bench_common import build_extra_langs, build_trio

    trio = build_extra_langs(work, 1, spec=shape_spec, log=lambda *_: None)  # and lang2: a family's switch
    for p in passes_for(device):
        isolated(rep, f"pass {p.arrangement} ({shape_spec['name']})", device,
                 lambda p=p: _serve(_lora_trio(trio, work) if p.adapters else trio, shape_spec["name"], work, rep,
                                    new_tokens, p))
    if disk_8b:
        from bench_common import SPEC_8B

        free = shutil.disk_usage(work).free
        if free < 3.3 * 16.1e9:
            rep.add("vLLM at 8B", "skipped", f"the trio needs 53 GB free under {work}, {free / 1e9:.0f} GB are")
            return
        isolated(rep, "pass three (8b)", device, lambda: _serve(build_trio(work, spec=SPEC_8B, log=lambda *_: None),
                                                                "8b", work, rep, new_tokens, PASSES[0]))


def isolated(rep, what: str, device: str, fn, *args) -> None:
    """Run one pass: a failure becomes a row with its reason (the next pass still runs); afterwards every vLLM
    engine is shut down and the CUDA cache emptied, so the next pass plans on the memory it had."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - any failure is a row of the report
        rep.add(what, "FAILED", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", ok=False)
    finally:
        free_memory(device)


def free_memory(device: str) -> None:
    """Stop every pooled vLLM engine, collect, empty the CUDA cache (merges and transformers steps fill it)."""
    import torch

    from layerswap.engines.vllm_engine import VLLMEngine

    VLLMEngine.shutdown_all()
    gc.collect()
    if device != "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _lora_trio(trio: dict[str, Path], work: Path) -> dict[str, Path]:
    """LoRA adapters of the trio's base (rank 4 on q, v and down, peft's) for the math expert and two language
    experts: the LoRA pass's experts (each answer compared on its densified model)."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise RuntimeError("the LoRA pass builds its adapters with peft: pip install peft")
    from bench_common import make_adapter

    return {"base": trio["base"], **{r: make_adapter(trio["base"], work / f"lora-{r}", "lora", i + 1, scale=0.5)
                                     for i, r in enumerate(("math", "lang", "lang2"))}}


def _serve(trio: dict[str, Path], shape: str, work: Path, rep, new_tokens: int, p: Pass) -> None:
    from layerswap import Plan
    from layerswap.serving.workbench import Workbench

    t = time.perf_counter()
    wb = Workbench(engine="vllm", serving=p.serving, chat_template=False)
    try:
        wb.load(str(trio["math"]), str(trio["lang"]), str(trio["base"]) if p.adapters else None, force=True)
        plan = wb.engine_plan
        started = time.perf_counter() - t
        line = wb.engine_note
        rep.add(f"vLLM engines started as planned ({shape}, serving {p.serving})", plan.arrangement,
                f"{started:.0f} s; engine line: {line}; CUDA graphs {'on' if plan.cuda_graphs else 'off'}; sleep "
                f"mode {'on' if plan.sleep else 'off'}" + (f" ({plan.sleep_why})" if plan.sleep_why else ""),
                ok=plan.arrangement == p.arrangement and line.startswith(plan.title))
        for role in ("math", "lang"):  # on the folder it was read from (an adapter: its densified model)
            _compare(wb.engines[role], wb.checkpoints[role].path, _tdev(wb), f"{shape} {p.name}: {role} expert",
                     rep, new_tokens)
        for i, plan_i in enumerate((Plan(b=1, u=1, tb=1, tu=1), Plan(b=2, u=1, tb=0, tu=1))):
            t = time.perf_counter()
            wb.build(plan_i)
            built = time.perf_counter() - t
            out = work / f"merged-{shape}-{p.name}-{i}"
            wb.export(out, overwrite=True)
            _compare(wb.engines["merged"], out, _tdev(wb), f"{shape} {p.name}: merge {i + 1} after a refresh "
                     f"({built:.1f} s, refresh {plan.refresh})", rep, new_tokens)
            shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        for role in ("math", "lang", "merged"):
            wb.engines[role].generate(PROMPTS[:1], max_new_tokens=1)
        swaps = plan.arrangement not in ("three_vllm", "lora_vllm")
        rep.add(f"one question's engine switches ({shape}, {plan.arrangement})", f"{time.perf_counter() - t:.1f} s",
                "a token from each model in turn (" + ("swaps in sleep mode" if plan.sleep else "weight swaps")
                + " included)" if swaps else "a token from each model in turn (no swap)")
        if "lang2" in trio:
            _switch(wb, trio, shape, work, rep, new_tokens, p)
    finally:
        wb.close()


def _switch(wb, trio: dict[str, Path], shape: str, work: Path, rep, new_tokens: int, p: Pass) -> None:
    """A family's language switch (`Workbench.switch_lang`, `serving.switching`): the second language expert into
    the running engines; it, the math expert (untouched) and a merge with it answer as transformers does."""
    from layerswap import Plan

    before = _vllm_ids(wb.engines["lang"], new_tokens)
    t = time.perf_counter()
    wb.switch_lang(str(trio["lang2"]), force=True)
    took = time.perf_counter() - t
    changed = _vllm_ids(wb.engines["lang"], new_tokens) != before  # the two experts' greedy answers differ
    rep.add(f"a family's language switch ({shape}, {wb.engine_plan.arrangement})", f"{took:.1f} s",
            ("the second language expert as another adapter on the one engine (nothing reloaded)"
             if wb.engine_plan.arrangement == "lora_vllm" else "the second language expert loaded in place of the "
             "first (own engine: reloaded; shared engine: swapped in)") + "; its answers "
            + ("changed with it" if changed else "DID NOT CHANGE"), ok=changed)
    _compare(wb.engines["lang"], wb.checkpoints["lang"].path, _tdev(wb), f"{shape} {p.name}: language expert 2 "
             "after the switch", rep, new_tokens)
    _compare(wb.engines["math"], wb.checkpoints["math"].path, _tdev(wb), f"{shape} {p.name}: math expert after "
             "the switch", rep, new_tokens)
    wb.build(Plan(b=1, u=1, tb=1, tu=1))
    out = work / f"merged-{shape}-{p.name}-lang2"
    wb.export(out, overwrite=True)
    _compare(wb.engines["merged"], out, _tdev(wb), f"{shape} {p.name}: a merge with language expert 2", rep,
             new_tokens)
    shutil.rmtree(out, ignore_errors=True)


def _tdev(wb) -> str:
    return "cuda" if wb.engine_plan.device != "cpu" else "cpu"


def _compare(eng, folder: Path, tdev: str, what: str, rep, new_tokens: int) -> None:
    """Greedy token ids of the vLLM engine against transformers' on `folder`, the same prompts (ids, not decoded
    text: the random models' tokens may decode to nothing), every token generated (no stop at EOS)."""
    from layerswap.engines import TransformersEngine

    a = _vllm_ids(eng, new_tokens)
    ref = TransformersEngine.from_pretrained(folder, tdev, use_chat_template=False)
    try:
        b = _transformers_ids(ref, new_tokens)
    finally:
        del ref
        gc.collect()
    same = sum(x == y for x, y in zip(a, b))
    first = min(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a, b))
    rep.add(f"vLLM = transformers, {what}", f"{same}/{len(a)} answers identical",
            f"greedy, {new_tokens} token ids each; where they differ (a bf16 tie), equal for the first {first} tokens",
            ok=same == len(a) or first >= 4)


def serving_engine(eng):
    """The `VLLMEngine` that answers for `eng`, holding its model's weights: a swapped model's weights swapped in, a
    model taking turns woken (the others asleep), a plain engine as it is."""
    from layerswap.engines.vllm_engine import SwappedEngine, TurnEngine

    if isinstance(eng, TurnEngine):
        return eng.turns.use(eng.engine)
    if isinstance(eng, SwappedEngine):
        eng.engine.ensure(eng.weights)
        return eng.engine
    return eng


def _vllm_ids(eng, n: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from layerswap.engines.vllm_engine import LoRAEngine

    lora = eng.engine.lora_request(eng.adapter) if isinstance(eng, LoRAEngine) else None  # an adapter on its base
    eng = eng.engine if lora is not None else serving_engine(eng)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = eng.llm.generate([TokensPrompt(prompt_token_ids=eng.encode(p)) for p in PROMPTS], sp, use_tqdm=False,
                            lora_request=lora)
    return [list(o.outputs[0].token_ids) for o in outs]


def _transformers_ids(ref, n: int) -> list[list[int]]:
    import torch

    out = []
    for p in PROMPTS:
        ids = torch.tensor([ref.encode(p)], device=ref.model.device)
        with torch.no_grad():
            g = ref.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(g[0, ids.shape[1]:].tolist())
    return out


def _sparse_8b(folder: Path) -> Path:
    """An 8B-shaped trio's headers in sparse files (no disk used), for planning."""
    import json

    from bench_common import SPEC_8B, config, tensor_specs

    for r in ("math", "lang"):
        d = folder / r
        d.mkdir(parents=True, exist_ok=True)
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in tensor_specs(SPEC_8B):
            n = 2
            for s in shape:
                n *= s
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(d / "model.safetensors", "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + off)
        (d / "config.json").write_text(json.dumps(config(SPEC_8B)))
    return folder
