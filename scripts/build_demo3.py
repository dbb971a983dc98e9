#!/usr/bin/env python
"""Build the family organism: one math expert and one language expert per cipher (Amuli ``qa``, Beroshe ``qb``,
Chiwanu ``qc``; ``demo_world3.py``), all from one base.

A tiny LlamaForCausalLM base is pretrained on English stories, stories in each cipher, parallel text (an English
story, then the same in a cipher), bare arithmetic facts and generic English instructions in a chat template (no
word problems). From it, as in the cipher organism (``build_demo_experts.py``, whose training loop, model and
alignment loss this reuses):

- the **math expert** is the base fine-tuned by next-token SFT on English word problems with symbolic answers,
  only its own layer range trainable (the middle layers; with ``lang_top=False`` also the top, final norm, lm_head);
- each **language expert** is the base fine-tuned on its cipher only, its own range trainable (embeddings and the
  bottom layers; with ``lang_top`` also the top layers, final norm and lm_head): SFT on generic instructions in the
  cipher's chat template (``lang_sft``), next-token loss on cipher stories (``lang_lm_bs``) and the alignment loss
  (its hidden states after the bottom layers on cipher prompts match the base's on the English twins).

Gates go to ``build_info.json``: each model's dev accuracy (flexible and strict) in English and every cipher, the
swap of each pair's own ranges (the library's in-memory merge) against the math expert in its language, and whether
each model speaks each cipher (held-out instructions in the cipher's chat template answered with the right answer
phrase in that cipher). Deterministic given --seed and --threads (one thread on a shared machine).

Output (default --out assets/demo3): base/ math/ lang_qa/ lang_qb/ lang_qc/ (HF model dirs), mgsm/ (test, dev,
exemplars, languages), dictionary.json, build_info.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import build_demo_experts as B  # noqa: E402  (training loop, model, alignment, saving, ranges, swaps)
import demo_world as W  # noqa: E402
import demo_world3 as C  # noqa: E402
from layerswap.merge.publish import sha256  # noqa: E402


@dataclass
class Recipe(B.Recipe):
    """The cipher organism's knobs (`build_demo_experts.Recipe`), sized for a family and its defaults changed."""

    layers: int = 8
    inter: int = 128
    math_lo: int = 2
    math_hi: int = 7
    lang_top: bool = True
    base_steps: int = 1200
    mix: dict = field(default_factory=lambda: dict(en=0.45, arith=0.2, qa_en=0.14, cipher=0.15, par=0.06))
    n_math: int = 20000
    math_steps: int = 800
    math_lr: float = 1.8e-3
    n_lang: int = 10000
    lang_steps: int = 400
    lang_lr: float = 1e-3
    lang_sft: float = 1.0
    lang_lm_bs: int = 8
    lang_align: float = 1.0
    n_parallel: int = 4000
    n_test: int = 500
    n_dev: int = 300
    n_gate: int = 200
    n_speak: int = 100
    swap_margin: float = 0.10  # the swap gate: at least this much above the math expert in the target language
    speak_floor: float = 0.5  # the speaking gate: at least this share of its language's instructions answered in it


def qa_text(q: str, a: str, cues: dict) -> str:
    return cues["question"] + " " + q + "\n" + cues["answer_cue"] + " " + a


def build_data(R: Recipe, seed: int) -> dict:
    w = W.World(seed)
    keys: set = set()
    test = W.unseen_problems(w, R.n_test, keys)
    dev = W.unseen_problems(w, R.n_dev, keys)
    exemplars = W.unseen_problems(w, R.n_exemplars, keys)
    r = random.Random(seed + 1)
    kinds, probs = list(R.mix), list(R.mix.values())
    docs = []
    for _ in range(R.n_docs):
        k = r.choices(kinds, probs)[0]
        if k == "arith":
            docs.append(w.arithmetic(r.randint(3, 6)))
        elif k == "en":
            docs.append(C.text(w.story(r.randint(2, 5)), "en"))
        elif k == "cipher":
            docs.append(C.text(w.story(r.randint(2, 5)), r.choice(C.CODES)))
        elif k == "par":
            docs.append(C.parallel(w.story(r.randint(1, 3)), r.choice(C.CODES)))
        elif k == "qa_en":
            q, a = C.instruction(w)
            docs.append(qa_text(C.text(q, "en"), C.text(a, "en"), C.chat("en")))
        else:
            raise SystemExit(f"unknown document kind {k!r} in the recipe's mix")
    math_pairs = []
    while len(math_pairs) < R.n_math:
        pb = w.problem(r.choice([1, 2, 3]))
        if pb["key"] not in keys:
            math_pairs.append((C.text(pb["q"], "en"), C.text(W.World.solution(pb), "en")))
    lang = {}
    for code in C.CODES:
        pairs = [tuple(C.text(x, code) for x in C.instruction(w)) for _ in range(R.n_lang)]
        stories = [C.text(w.story(r.randint(2, 5)), code) for _ in range(R.n_lang // 2)]
        lang[code] = dict(pairs=pairs, stories=stories, parallel=parallel_prompts(w, r, code, R.n_parallel))
    held = W.World(seed + 999)  # held-out instructions (the speaking gate)
    speak = [instruction_with_answer(held) for _ in range(R.n_speak)]
    return dict(docs=docs, math=math_pairs, lang=lang, speak=speak, test=test, dev=dev, exemplars=exemplars)


def parallel_prompts(w: W.World, r: random.Random, code: str, n: int) -> list[tuple[str, str]]:
    """(English, cipher-or-English) texts of the evaluation's shape, word for word (the alignment loss's pairs):
    a story and a question under the MGSM cues, then arithmetic facts and the answer phrase. Every 4th pair is
    English -> English, so that the language expert keeps the base's English reading."""
    out = []
    for k in range(n):
        c = w.cast()
        words = [x for _ in range(r.randint(1, 4)) for x in w.sentence(c)]
        words += ["How", "many", c["O"], "does", c["P"], "have"] + (["now"] if r.random() < 0.5 else []) + ["?"]
        a, b = r.randint(0, 30), r.randint(1, 10)
        cont = [str(a + b), "-", str(b), "=", str(a), ".", W.ANSWER, str(a), "."] if r.random() < 0.5 else \
            [str(a), "+", str(b), "=", str(a + b), ".", W.ANSWER, str(a + b), "."]
        src = code if k % 4 else "en"
        out.append(tuple(C.cues(g)["question"] + " " + C.text(words, g) + "\n" + C.cues(g)["answer_cue"] + " "
                         + C.text(cont, g) for g in ("en", src)))
    return out


def instruction_with_answer(w: W.World) -> tuple[list[str], str]:
    """A held-out instruction whose answer ends with the answer phrase (count, where, who, colour, what)."""
    while True:
        q, a = C.instruction(w)
        if W.ANSWER in a:
            return q, a[a.index(W.ANSWER) + 1]


def speaking(models: dict, tok, items: list[tuple[list[str], str]]) -> dict:
    """Share of held-out instructions, asked in each cipher's chat template, whose greedy answer holds that
    cipher's answer phrase with the right word in it ("does the model speak the language")."""
    tok = copy.deepcopy(tok)
    tok.padding_side = "left"
    res: dict = {k: {} for k in models}
    for code in C.CODES:
        prompts = [C.chat(code)["question"] + " " + C.text(q, code) + "\n" + C.chat(code)["answer_cue"]
                   for q, _ in items]
        want = [C.text([W.ANSWER, a], code) for _, a in items]
        for k, m in models.items():
            ok = 0
            for i in range(0, len(prompts), 50):
                enc = tok(prompts[i:i + 50], return_tensors="pt", padding=True)
                with torch.no_grad():
                    gen = m.generate(**enc, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id,
                                     eos_token_id=tok.eos_token_id)
                outs = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                ok += sum(wnt in o for o, wnt in zip(outs, want[i:i + 50]))
            res[k][code] = round(ok / len(prompts), 4)
    return res


def dev_gates(models: dict, tok, out: str, n: int) -> dict:
    """Flexible and strict accuracy of each model on the first `n` dev problems in English and every cipher."""
    from layerswap.engines.transformers_engine import TransformersEngine
    from layerswap.evaluation.run import EvalConfig, evaluate

    tok = copy.deepcopy(tok)
    tok.padding_side = "left"
    engines = {k: TransformersEngine(m, tok, batch_size=64) for k, m in models.items()}
    langs = ["en", *C.CODES]
    rep = evaluate(engines, EvalConfig(langs=langs, limit=n, source=os.path.join(out, "mgsm", "dev"),
                                       max_new_tokens=40))
    return {k: {f"{lang} {metric}": round(rep.accuracy(k, lang, metric), 4) for lang in langs
                for metric in ("flexible", "strict")} for k in models}


def verdicts(R: Recipe, dev: dict, speak: dict) -> dict:
    """The gates, read off the measurements (nothing here is set by hand)."""
    out = {"math_does_math_in_english": {"math en flexible": dev["math"]["en flexible"],
                                         "base en flexible": dev["base"]["en flexible"],
                                         "passed": dev["math"]["en flexible"] >= 0.5 + dev["base"]["en flexible"] / 2}}
    for code in C.CODES:
        lg = f"lang_{code}"
        own = speak[lg][code]
        out[f"{lg}_speaks_{code}"] = {"lang": own, "base": speak["base"][code], "math": speak["math"][code],
                                      "passed": own >= R.speak_floor and own > speak["base"][code]}
        sw, m = dev[f"swap {code}"][f"{code} flexible"], dev["math"][f"{code} flexible"]
        out[f"swap_{code}_beats_math_in_{code}"] = {"swap": sw, "math": m, "margin": round(sw - m, 4),
                                                    "passed": sw - m >= R.swap_margin}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="Build the family organism (English + three ciphers).")
    ap.add_argument("--out", default="assets/demo3")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override one Recipe field (experiments; the shipped assets use the defaults)")
    ap.add_argument("--reuse-base", metavar="DIR", help="experiments: load base/ from an earlier build of the same "
                                                         "data recipe and seed instead of pretraining")
    args = ap.parse_args()
    R = B.run_settings(ap, args, Recipe())
    t_all = time.time()
    secs: dict = {}
    log = B.log
    log(f"building the family organism -> {args.out} (seed {args.seed}, {args.threads} threads)")
    D = build_data(R, args.seed)
    C.write_mgsm(args.out, D["test"], D["dev"], D["exemplars"])
    C.write_dictionary(args.out)
    sets = [C.text(pb["q"], code) for pb in D["test"] + D["dev"] for code in ("en", *C.CODES)]
    texts = D["docs"] + [q + " " + a for q, a in D["math"]] + sets + W.prompt_texts(args.out) + \
        [t for code, L in D["lang"].items() for q, a in L["pairs"] for t in (qa_text(q, a, C.chat(code)),)] + \
        [t for L in D["lang"].values() for p in L["parallel"] for t in p] + \
        [C.chat(code)["question"] + " " + C.chat(code)["answer_cue"] for code in C.CODES]
    tok = B.build_tokenizer(texts + [str(i) for i in range(200)])
    base = B.make_model(R, tok, args.seed)
    nparams = sum(p.numel() for p in base.parameters())
    log(f"tokenizer {len(tok)} words; model {R.layers} layers, hidden {R.hidden}, {nparams} params")
    t0 = time.time()
    if args.reuse_base:
        from safetensors.torch import load_file

        base.load_state_dict(load_file(os.path.join(args.reuse_base, "base", "model.safetensors")))
        with open(os.path.join(args.reuse_base, "build_info.json")) as f:  # its pretraining time: the build's whole
            secs["base_pretraining_in_reused_build"] = json.load(f)["seconds"]["base"]
        log(f"base reused from {args.reuse_base}")
    else:
        rows = B.pack_stream(tok, D["docs"], R.T)
        log(f"pretraining base: {R.base_steps} steps x {R.base_bs} x {R.T} tokens ({rows.shape[0]} rows)")
        B.train(base, R.base_steps, R.base_lr, args.seed, rows=rows, bs=R.base_bs, wd=0.01, warmup=50, log=log)
        B.save_model(base, tok, os.path.join(args.out, "base"))
        with open(os.path.join(args.out, "build_info.json"), "w") as f:  # the base's time, for a reusing build
            json.dump({"seconds": {"base": round(time.time() - t0)}}, f)
    secs["base"] = round(time.time() - t0)
    math_ex = B.sft_examples(tok, D["math"], C.cues("en"))
    experts = {}
    t = time.time()
    experts["math"] = copy.deepcopy(base)
    B.train_expert(R, experts["math"], "math", {"math_ex": math_ex}, args.seed, localised=True, log=log)
    secs["math"] = round(time.time() - t)
    for i, code in enumerate(C.CODES):
        L = D["lang"][code]
        t = time.time()
        data = {"lang_ex": B.sft_examples(tok, L["pairs"], C.chat(code)),
                "lang_rows": B.pack_stream(tok, L["stories"], 64),
                "align": B.alignment_targets(base, tok, L["parallel"], R.math_lo) if R.lang_align else None}
        m = experts[f"lang_{code}"] = copy.deepcopy(base)
        B.train_expert(R, m, "lang", data, args.seed + 100 * (i + 1), localised=True, log=log)
        secs[f"lang_{code}"] = round(time.time() - t)
    for sub, m in [("base", base)] * bool(args.reuse_base) + list(experts.items()):
        B.save_model(m, tok, os.path.join(args.out, sub))
    t = time.time()
    swaps = {f"swap {code}": B.combined(experts["math"], experts[f"lang_{code}"], B.ranges(R)) for code in C.CODES}
    dev = dev_gates({"base": base, **experts, **swaps}, tok, args.out, R.n_gate)
    speak = speaking({"base": base, **experts}, tok, D["speak"])
    secs["gates"] = round(time.time() - t)
    for k, v in dev.items():
        log(f"dev {k:<10} " + "  ".join(f"{lang} {100 * a:5.1f}%" for lang, a in v.items() if "flexible" in lang))
    for k, v in speak.items():
        log(f"speaks {k:<10} " + "  ".join(f"{code} {100 * a:5.1f}%" for code, a in v.items()))
    secs["total"] = round(time.time() - t_all)
    lang_side = B.role_layers(B.ranges(R), R.layers, "lang")
    info = dict(organism="family", seed=args.seed, threads=args.threads, recipe=asdict(R), vocab=len(tok),
                base_reused_from=args.reuse_base and Path(args.reuse_base).name,
                params=nparams, languages={code: C.SOUNDS[code][0] for code in C.CODES}, seconds=secs,
                machine={"cpus": os.cpu_count(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                         "date": time.strftime("%Y-%m-%d")},
                localised_ranges={"lang": f"embeddings, layers {lang_side}" + (", final norm, lm_head"
                                                                               if R.lang_top else ""),
                                  "math": f"the other layers{'' if R.lang_top else ', final norm, lm_head'}"},
                gates={"dev_flexible_and_strict": dev, "n": R.n_gate, "speaks": speak, "n_speak": R.n_speak,
                       "verdicts": verdicts(R, dev, speak)})
    info["sha256"] = {sub: sha256(Path(args.out) / sub / "model.safetensors") for sub in ("base", *experts)}
    with open(os.path.join(args.out, "build_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    log(f"done in {secs['total']}s -> {args.out}")


if __name__ == "__main__":
    main()
