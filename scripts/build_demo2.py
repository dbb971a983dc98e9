#!/usr/bin/env python
"""Build the demo organism in the paper's setting: English and Oruki (``yy``, verb-final, with suffixes).

A tiny LlamaForCausalLM base is pretrained on a multilingual, numerate mix (the default recipe): English
stories, fewer Oruki stories, stories that switch language, stories that keep count (English, Oruki, parallel),
parallel stories, bare arithmetic facts, generic English instructions (reading comprehension and retelling, in a
chat template) and word problems with worked answers in English and, fewer, in Oruki. Then, as in Bandarkar et
al. 2025 and Bandarkar & Peng 2025:

- the **math expert** is the base fine-tuned by next-token SFT on English word problems with symbolic
  answers, every tensor trainable (``math_scope="all"``; ``"middle"`` trains only its middle layers);
- the **language expert** is the base fine-tuned by ordinary next-token SFT on generic Oruki instructions
  with Oruki answers ("... Danu X ki."), no maths, in a chat template, with English instructions mixed in
  (``lang_replay``), either with only the bottom and top layers (and the embeddings, final norm and lm_head)
  trainable (``lang/``), or with every tensor trainable and the middle layers reverted to the base afterwards
  (``lang_revert/``).

The other Recipe fields are the knobs of the designs in ``assets/demo/DESIGNS.md`` (``--set KEY=JSON``).
Gates (dev accuracy of each model and of the swap of the experts' own ranges, flexible and strict) go to
``build_info.json``. Deterministic given --seed and --threads (one thread on a shared machine).

Output (default --out assets/demo2): base/ math/ lang/ lang_revert/ (HF model dirs), mgsm/ (test, dev,
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
import build_demo_experts as B  # noqa: E402  (training loop, model, saving, profiles)
import demo_world as W  # noqa: E402
import demo_world2 as O  # noqa: E402
from layerswap.merge.publish import sha256  # noqa: E402

T = O.CODE


@dataclass
class Recipe:
    layers: int = 10
    hidden: int = 64
    inter: int = 192
    heads: int = 1
    lang_bottom: int = 2  # the language expert's layers: 0 .. lang_bottom-1 and layers-lang_top .. layers-1
    lang_top: int = 2
    n_docs: int = 40000
    T: int = 128
    base_steps: int = 1500
    base_bs: int = 16
    base_lr: float = 3e-3
    mix: dict = field(default_factory=lambda: dict(en=0.2, yy=0.05, mixed=0.05, narr_en=0.05, narr_yy=0.05,
                                                   narr_par=0.05, par=0.05, arith=0.1, qa_en=0.25, wp_en=0.1,
                                                   wp_yy=0.05))
    n_math: int = 20000
    math_steps: int = 600
    math_bs: int = 32
    math_lr: float = 5e-4
    n_lang: int = 20000
    lang_steps: int = 600
    lang_bs: int = 32
    lang_lr: float = 5e-4
    lang_prompt_loss: bool = False  # next-token loss on the instruction too (else on the answer only)
    lang_translate: float = 0.0  # share of the language expert's instructions that are English -> Oruki translations
    lang_own_rows: bool = False  # the language expert trains only the embedding rows of words English never uses
    full_lr_scale: float = 0.3  # the fully trained language expert's lr, relative to the localised one's
    math_scope: str = "all"  # "middle": only the math range trainable; "all": every tensor (experts overlap)
    lang_replay: float = 0.25  # English instructions mixed into the language SFT, as a fraction of n_lang (replay)
    verb_final: bool = True  # Oruki's clause order: verb-final (True) or subject-verb-object (False)
    yy_answer_phrase: bool = True  # the base's Oruki word problems end with "Danu N ki." (else with the last equation)
    chat_cues: bool | str = True  # generic instructions in a chat template, not MGSM's cues: True for the base's qa_en
    # and the language SFT, "lang" for the language SFT only, False for neither
    n_test: int = 1000
    n_dev: int = 300
    n_gate: int = 200
    n_exemplars: int = 8


def ranges(R: Recipe):
    """This organism's ranges as a layer map of the library's planner: the language expert's bottom and top layers
    (with the embeddings, final norm and lm_head, which follow layers 0 and L-1), the math expert's middle."""
    return B.Plan(b=R.lang_bottom, u=R.lang_top, tb=0, tu=0)


CHAT = {"en": {"question": "User:", "answer_cue": "Assistant:"}, T: {"question": "Tu:", "answer_cue": "Pomo:"}}


def instruction_cues(lang: str, R: Recipe, base: bool = False) -> dict:
    """The cues of a generic instruction (`base`: in the base's pretraining; else in the language SFT): a chat template
    (``chat_cues``) or the MGSM prompt's."""
    return CHAT[lang] if R.chat_cues is True or (R.chat_cues == "lang" and not base) else O.language_entry(lang)


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
        elif k in ("en", T):
            docs.append(O.text(w.story(r.randint(2, 5)), k))
        elif k == "mixed":
            docs.append(O.mixed_story(w, r.randint(2, 5), r))
        elif k == "par":  # a story, then the same story in Oruki
            docs.append(O.parallel(w.story(r.randint(2, 4))))
        elif k == "narr_par":  # a story that keeps count, then the same story in Oruki
            docs.append(O.parallel(O.narrative_words(w, keys, r)))
        elif k.startswith("narr_"):  # stories that keep count: narr_en, narr_yy, narr_mixed
            docs.append(O.narrative(w, keys, r, ("en", T) if k == "narr_mixed" else (k[5:],)))
        elif k in ("wp_en", "wp_yy"):  # a word problem (never a test or dev one) with its worked answer, MGSM's cues
            lang = k[3:]
            while (pb := w.problem(r.choice([1, 2, 3])))["key"] in keys:
                pass
            sol = W.World.solution(pb)
            sol = sol[: sol.index(W.ANSWER)] if lang == T and not R.yy_answer_phrase else sol
            docs.append(qa_text(O.text(pb["q"], lang), O.text(sol, lang), O.language_entry(lang)))
        elif k == "qa_en":  # a generic English instruction with its answer (chat template or MGSM's cues)
            q, a = O.instruction(w)
            docs.append(qa_text(O.text(q, "en"), O.text(a, "en"), instruction_cues("en", R, base=True)))
        else:
            raise SystemExit(f"unknown document kind {k!r} in the recipe's mix")
    math_pairs = []
    while len(math_pairs) < R.n_math:
        pb = w.problem(r.choice([1, 2, 3]))
        if pb["key"] not in keys:
            math_pairs.append((O.text(pb["q"], "en"), O.text(W.World.solution(pb), "en")))
    lang_pairs = [O.translation(w) if r.random() < R.lang_translate else
                  tuple(O.text(x, T) for x in O.instruction(w)) for _ in range(R.n_lang)]
    replay = [tuple(O.text(x, "en") for x in O.instruction(w)) for _ in range(round(R.n_lang * R.lang_replay))]
    return dict(docs=docs, math=math_pairs, lang=lang_pairs, replay=replay, test=test, dev=dev, exemplars=exemplars)


OR_SPLIT = r"[.,:?!\n]|-[a-z]+"  # punctuation and Oruki's suffixes (``-ni``, ``-a`` ...) are tokens of their own


def gates(models: dict, tok, out: str, n: int) -> dict:
    """Flexible and strict accuracy of each model on the first `n` dev problems, in English and Oruki, and on the
    cue-swap probes (``ye``: Oruki body, English cues; ``ey``: English body, Oruki cues)."""
    from layerswap.engines.transformers_engine import TransformersEngine
    from layerswap.evaluation.run import EvalConfig, evaluate

    tok = copy.deepcopy(tok)
    tok.padding_side = "left"
    engines = {k: TransformersEngine(m, tok, batch_size=64) for k, m in models.items()}
    res: dict = {k: {} for k in models}
    for sub, langs in (("dev", ["en", T]), ("probe", ["ye", "ey"])):
        rep = evaluate(engines, EvalConfig(langs=langs, limit=n, source=os.path.join(out, "mgsm", sub),
                                           max_new_tokens=40))
        for k in models:
            res[k].update({f"{lang} {metric}": round(rep.accuracy(k, lang, metric), 4) for lang in langs
                           for metric in ("flexible", "strict")})
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description="Build the demo organism in the paper's setting (English + Oruki).")
    ap.add_argument("--out", default="assets/demo2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override one Recipe field (experiments; the shipped assets use the defaults)")
    ap.add_argument("--reuse-base", metavar="DIR", help="experiments: load base/ from an earlier build of the same "
                                                         "data recipe instead of pretraining")
    ap.add_argument("--only", nargs="+", default=["math", "lang", "lang_revert"],
                    help="experiments: experts to train (the others are skipped, or reused from --reuse-base DIR)")
    args = ap.parse_args()
    R = B.run_settings(ap, args, Recipe())
    O.VERB_FINAL = R.verb_final
    t_all = time.time()
    secs: dict = {}
    log = B.log
    log(f"building the paper-setting organism -> {args.out} (seed {args.seed}, {args.threads} threads)")
    D = build_data(R, args.seed)
    O.write_mgsm(args.out, D["test"], D["dev"], D["exemplars"])
    O.write_dictionary(args.out)
    sets = [O.text(pb["q"], lang) for pb in D["test"] + D["dev"] for lang in ("en", T)]
    texts = D["docs"] + [q + " " + a for q, a in D["math"]] + sets + \
        [qa_text(q, a, instruction_cues(T, R)) for q, a in D["lang"]] + \
        [qa_text(q, a, instruction_cues("en", R)) for q, a in D["replay"]] + W.prompt_texts(args.out)
    tok = B.build_tokenizer(texts + [str(i) for i in range(200)], split=OR_SPLIT)
    base = B.make_model(R, tok, args.seed)
    nparams = sum(p.numel() for p in base.parameters())
    log(f"tokenizer {len(tok)} words; model {R.layers} layers, hidden {R.hidden}, {nparams} params")
    from safetensors.torch import load_file

    t0 = time.time()
    if args.reuse_base:
        base.load_state_dict(load_file(os.path.join(args.reuse_base, "base", "model.safetensors")))
        log(f"base reused from {args.reuse_base}")
    else:
        rows = B.pack_stream(tok, D["docs"], R.T)
        log(f"pretraining base: {R.base_steps} steps x {R.base_bs} x {R.T} tokens ({rows.shape[0]} rows)")
        B.train(base, R.base_steps, R.base_lr, args.seed, rows=rows, bs=R.base_bs, wd=0.01, warmup=50, log=log)
    secs["base"] = round(time.time() - t0)
    english_ids = {i for d in D["docs"] if not any(c in d for c in "-")
                   for i in tok(d)["input_ids"]} | {i for q, a in D["math"] for i in tok(q + " " + a)["input_ids"]}
    math_ex = B.sft_examples(tok, D["math"], O.language_entry("en"))
    lang_ex = B.sft_examples(tok, D["lang"], instruction_cues(T, R), prompt_loss=R.lang_prompt_loss) + \
        B.sft_examples(tok, D["replay"], instruction_cues("en", R), prompt_loss=R.lang_prompt_loss)
    experts = {}

    def train(role: str, localised: bool):
        m = copy.deepcopy(base)
        t = time.time()
        lr = (R.math_lr if role == "math" else R.lang_lr) * (1.0 if localised else R.full_lr_scale)
        log(f"{role} expert ({'own layer range' if localised else 'all tensors'}, lr {lr:g})")
        own = B.role_of(ranges(R), R.layers)
        only = (lambda n: own(n) == role) if localised and not (role == "math" and R.math_scope == "all") \
            else (lambda n: True)
        if role == "lang" and R.lang_own_rows:  # embedding rows of words that English text also uses stay put
            keep = torch.ones(len(tok), 1)
            keep[sorted(english_ids)] = 0.0
            hook = m.model.embed_tokens.weight.register_hook(lambda g: g * keep)
        steps, exs, bs = (R.math_steps, math_ex, R.math_bs) if role == "math" else (R.lang_steps, lang_ex, R.lang_bs)
        B.train(m, steps, lr, args.seed + (11 if role == "math" else 12), exs=exs, ex_bs=bs, trainable=only, log=log)
        if role == "lang" and R.lang_own_rows:
            hook.remove()
        secs[f"{role}{'' if localised else '_full'}"] = round(time.time() - t)
        return m

    for name in ("math", "lang", "lang_revert"):
        if name in args.only:
            experts[name] = B.reverted(train("lang", False), base, "lang", ranges(R)) if name == "lang_revert" else \
                train(name, True)
        elif args.reuse_base and os.path.exists(os.path.join(args.reuse_base, name, "model.safetensors")):
            experts[name] = copy.deepcopy(base)
            experts[name].load_state_dict(load_file(os.path.join(args.reuse_base, name, "model.safetensors")))
            log(f"{name} reused from {args.reuse_base}")
    for sub, m in [("base", base), *experts.items()]:
        B.save_model(m, tok, os.path.join(args.out, sub))
    t = time.time()
    swaps = {f"swap ({k})": B.combined(experts["math"], experts[k], ranges(R))
             for k in ("lang", "lang_revert") if k in experts and "math" in experts}
    gate = gates({"base": base, **experts, **swaps}, tok, args.out, R.n_gate)
    secs["gates"] = round(time.time() - t)
    for k, v in gate.items():
        log(f"gate {k:<20} " + "  ".join(f"{lang} {100 * a:5.1f}%" for lang, a in v.items()))
    secs["total"] = round(time.time() - t_all)
    L = R.layers
    info = dict(organism="paper", seed=args.seed, threads=args.threads, recipe=asdict(R), vocab=len(tok),
                params=nparams, base_reused_from=args.reuse_base, seconds=secs,
                machine={"cpus": os.cpu_count(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                         "date": time.strftime("%Y-%m-%d")},
                localised_ranges={"math": f"layers {R.lang_bottom}-{L - R.lang_top - 1}",
                                  "lang": f"embeddings, layers 0-{R.lang_bottom - 1} and {L - R.lang_top}-{L - 1}, "
                                          "final norm, lm_head"},
                gates={"dev_flexible_and_strict": gate, "n": R.n_gate})
    if {"math", "lang"} <= set(experts):
        info["change_profile"] = B.change_profiles(args.out)
    info["sha256"] = {sub: sha256(Path(args.out) / sub / "model.safetensors")
                      for sub in ("base", "math", "lang", "lang_revert")
                      if (Path(args.out) / sub / "model.safetensors").exists()}
    with open(os.path.join(args.out, "build_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    log(f"done in {secs['total']}s -> {args.out}")


if __name__ == "__main__":
    main()
