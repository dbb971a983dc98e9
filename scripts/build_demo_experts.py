#!/usr/bin/env python
"""Build the offline layer-swapping "demo organism" (English + the relexified language Kovani, ``xx``).

A tiny LlamaForCausalLM base is pretrained on English stories, a little Kovani (the lower-resource
language) and bare arithmetic facts. Two experts are fine-tuned from it on their own layer ranges,
as in Bandarkar & Peng 2025 (modular fine-tuning): the math expert updates only the middle layers
on English word problems with symbolic answers; the language expert updates only the embeddings,
the bottom and top layers, the final norm and lm_head on Kovani instructions and text (no math).
The same data also trains an unconstrained pair (every tensor trainable), shipped as
``unlocalised/``; reverting its other layer ranges to the base gives the "train, then revert"
variant. Gates (the experts on the dev set in both languages, cue-swap probes, the base's
cross-lingual alignment) go to ``build_info.json``. Deterministic given --seed and --threads.

Output (default --out assets/demo): base/ math/ lang/ unlocalised/{math,lang}/ (HF model dirs),
mgsm/ (test sets, dev/, probe/, exemplars, languages), build_info.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # layerswap, run from anywhere
sys.path.insert(0, HERE)
import demo_world as W  # noqa: E402
from demo_measure import change_profiles, gates, retrieval  # noqa: E402,F401  (build_demo2 uses them through here)
from layerswap.merge.merging import merge_in_memory  # noqa: E402
from layerswap.recipe.plans import Plan  # noqa: E402
from layerswap.merge.publish import sha256  # noqa: E402
from layerswap.recipe.sources import Sources  # noqa: E402


@dataclass
class Recipe:
    layers: int = 8
    hidden: int = 64
    inter: int = 192
    heads: int = 1  # head_dim 64: vLLM's CPU attention needs >= 64
    math_lo: int = 2  # the math expert trains layers math_lo .. math_hi-1; the language expert the rest
    math_hi: int = 8
    n_docs: int = 40000
    T: int = 128
    base_steps: int = 1000
    base_bs: int = 16
    base_lr: float = 3e-3
    mix: dict = field(default_factory=lambda: dict(en=0.66, xx=0.06, arith=0.28))
    n_math: int = 40000
    math_steps: int = 1000
    math_bs: int = 32
    math_lr: float = 1.8e-3
    n_lang: int = 20000
    lang_steps: int = 400
    lang_bs: int = 32
    lang_lr: float = 1e-3
    lang_lm_bs: int = 0  # rows of Kovani stories (full LM loss) per language-expert step
    lang_sft: float = 0.0  # weight of the Kovani instructions' loss in the language expert
    lang_align: float = 1.0  # weight of the alignment loss (Kovani hidden state at layer math_lo vs the base's English)
    align_bs: int = 32
    n_parallel: int = 8000
    full_lr_scale: float = 0.3  # the unconstrained pair's lr, relative to the localised experts'
    lang_top: bool = False  # the language range also holds the top layers (math_hi..), final norm and lm_head
    localise: str = "freeze"  # shipped math/ and lang/: "freeze" (train own range) or "revert" (train all, revert)
    n_test: int = 1000
    n_dev: int = 300
    n_probe: int = 300
    n_gate: int = 200
    n_align: int = 200
    n_exemplars: int = 8


# ---------------------------------------------------------------- data
def build_data(R: Recipe, seed: int) -> dict:
    w = W.World(seed)
    keys: set = set()
    test = W.unseen_problems(w, R.n_test, keys)
    dev = W.unseen_problems(w, R.n_dev, keys)
    probe = W.unseen_problems(w, R.n_probe, keys)
    exemplars = W.unseen_problems(w, R.n_exemplars, keys)
    r = random.Random(seed + 1)
    kinds, probs = list(R.mix), list(R.mix.values())
    docs = []
    for _ in range(R.n_docs):
        k = r.choices(kinds, probs)[0]
        if k == "arith":
            docs.append(w.arithmetic(r.randint(3, 6)))
        elif k in ("en", "xx"):
            docs.append(W.text(w.story(r.randint(2, 5)), k))
        elif k == "par":  # a sentence then its translation
            s = w.story(1)
            docs.append(W.text(s, "en") + " " + W.text(s, "xx"))
        else:
            raise SystemExit(f"unknown document kind {k!r} in the recipe's mix")
    math_pairs = []
    while len(math_pairs) < R.n_math:
        pb = w.problem(r.choice([1, 2, 3]))
        if pb["key"] not in keys:
            math_pairs.append((W.text(pb["q"], "en"), W.text(W.World.solution(pb), "en")))
    lang_pairs = []
    for _ in range(R.n_lang):
        q, a = w.instruction()
        lang_pairs.append((W.realise_instruction(q, "xx"), W.text(a, "xx")))
    lang_docs = [W.text(w.story(r.randint(2, 5)), "xx") for _ in range(R.n_lang // 2)]
    parallel = []  # (English, Kovani-or-English) prompts of the evaluation's shape, no answer to the question
    for k in range(R.n_parallel):
        c = w.cast()
        words = [x for _ in range(r.randint(1, 4)) for x in w.sentence(c)]
        words += ["How", "many", c["O"], "does", c["P"], "have"] + (["now"] if r.random() < 0.5 else []) + ["?"]
        # a continuation of random arithmetic facts (unrelated to the story), so that generated tokens after a
        # Kovani prompt read as they do after an English one
        a, b = r.randint(0, 30), r.randint(1, 10)
        cont = f" {a + b} - {b} = {a}. " + W.text([W.ANSWER, str(a), "."], "en") if r.random() < 0.5 else \
            f" {a} + {b} = {a + b}. " + W.text([W.ANSWER, str(a + b), "."], "en")
        src = "xx" if k % 4 else "en"  # every 4th pair is English -> English: keep the base's English reading
        parallel.append(tuple(W.CUES[g]["question"] + " " + W.text(words, g) + "\n" + W.CUES[g]["answer_cue"] + cont
                              for g in ("en", src)))
    align, seen = [], set()
    aw = W.World(seed + 777)
    while len(align) < R.n_align:
        s = [("7" if x.isdigit() else x) for x in aw.sentence(dict(aw.cast(), P="Tom", Q="Mia"))]
        e = W.text(s, "en")
        if e not in seen:
            seen.add(e)
            align.append((e, W.text(s, "xx")))
    return dict(docs=docs, math=math_pairs, lang=lang_pairs, lang_docs=lang_docs, parallel=parallel, test=test, dev=dev, probe=probe,
                exemplars=exemplars, align=align)


# ---------------------------------------------------------------- tokenizer, model
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def build_tokenizer(texts: list[str], split: str = r"[.,:?!\n]") -> PreTrainedTokenizerFast:
    """Word-level tokenizer (Metaspace, then `split` — punctuation — split off as tokens) that prepends <s> like
    every training row."""
    pt = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True),
        pre_tokenizers.Split(Regex(split), behavior="isolated")])
    words = sorted({w for t in texts for w, _ in pt.pre_tokenize_str(t)})
    vocab = {t: i for i, t in enumerate(SPECIALS + words)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pt
    tk.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", clean_up_tokenization_spaces=False)


def make_model(R: Recipe, tok, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=R.hidden, intermediate_size=R.inter,
                      num_hidden_layers=R.layers, num_attention_heads=R.heads, num_key_value_heads=R.heads,
                      head_dim=R.hidden // R.heads, max_position_embeddings=512, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, initializer_range=0.02)
    return LlamaForCausalLM(cfg)


def ranges(R: Recipe) -> Plan:
    """The experts' ranges as a layer map of the library's planner: the language expert's layers (0 .. math_lo-1,
    and with `lang_top` the layers from math_hi on) are the map's language side, the rest the math expert's;
    outside the layers the planner's rule decides (embeddings follow layer 0, final norm and lm_head the last
    layer). Training, reverting and the swap below all ask the planner (`layerswap.recipe.sources`) through it."""
    return Plan(b=R.math_lo, u=R.layers - R.math_hi if R.lang_top else 0, tb=0, tu=0)


def role_of(plan: Plan, num_layers: int):
    """``name -> "math" | "lang"``: whose range a tensor is in, as the planner gives its source for `plan`."""
    src = Sources(plan, num_layers)
    return lambda name: "lang" if src.of([name])[name].w_lang == 1.0 else "math"


def role_layers(plan: Plan, num_layers: int, role: str) -> list[int]:
    """The layers of `role`'s range (the planner's layer strip)."""
    return [i for i, s in enumerate(Sources(plan, num_layers).layers()) if (s.w_lang == 1.0) == (role == "lang")]


def combined(math_model, lang_model, plan: Plan):
    """A copy of `math_model` holding the math range from `math_model` and the language range from `lang_model`:
    the library's in-memory merge (`layerswap.merge.merging.merge_in_memory`) of `plan`. The swap is
    ``combined(math, lang)``; "train, then revert" is ``combined(full, base)`` (math) or ``combined(base, full)``."""
    L = math_model.config.num_hidden_layers
    sd = merge_in_memory(math_model.state_dict(), lang_model.state_dict(), L, plan)
    m = copy.deepcopy(math_model)
    m.load_state_dict(sd)
    return m


def reverted(full, base, role: str, plan: Plan):
    """`full` with every tensor outside `role`'s range set back to the base ("train, then revert")."""
    return combined(full, base, plan) if role == "math" else combined(base, full, plan)


# ---------------------------------------------------------------- training
def lr_at(step: int, total: int, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def pack_stream(tok, docs: list[str], T: int) -> torch.Tensor:
    ids: list[int] = []
    for d in docs:
        ids += tok(d)["input_ids"] + [tok.eos_token_id]  # tok() prepends <s>
    n = len(ids) // T
    return torch.tensor(ids[: n * T]).view(n, T)


def sft_examples(tok, pairs: list[tuple[str, str]], cues: dict, prompt_loss: bool = False
                 ) -> list[tuple[list[int], list[int]]]:
    """Prompt exactly as layerswap's MGSM evaluation builds it (``<s>Cue: q\\nAnswerCue``) with `cues` (a
    language's question and answer cues); loss on the answer (and on the prompt too with `prompt_loss`)."""
    out = []
    for q, a in pairs:
        p = tok(cues["question"] + " " + q + "\n" + cues["answer_cue"])["input_ids"]
        t = tok(" " + a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((p + t, ([-100] + p[1:] if prompt_loss else [-100] * len(p)) + t))
    return out


def collate(exs, pad: int):
    T = max(len(i) for i, _ in exs)
    x = torch.full((len(exs), T), pad)
    y = torch.full((len(exs), T), -100)
    m = torch.zeros((len(exs), T), dtype=torch.long)
    for k, (i, lab) in enumerate(exs):
        x[k, :len(i)] = torch.tensor(i)
        y[k, :len(lab)] = torch.tensor(lab)
        m[k, :len(i)] = 1
    return x, y, m


def train(model, steps: int, lr: float, seed: int, *, rows=None, bs: int = 16, exs=None, ex_bs: int = 32,
          trainable=lambda n: True, wd: float = 0.0, warmup: int = 30, log=None, every: int = 200,
          on_step=None, ex_weight: float = 1.0, align=None, align_layer: int = 0, align_weight: float = 0.0,
          align_bs: int = 32) -> None:
    """AdamW with cosine schedule on LM `rows` (full loss) and/or SFT `exs` (answer-only loss)."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for n, p in model.named_parameters():
        p.requires_grad_(trainable(n))
        if p.requires_grad:
            params.append(p)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, betas=(0.9, 0.98))
    model.train()
    t0 = time.time()
    for s in range(steps):
        for pg in opt.param_groups:
            pg["lr"] = lr_at(s, steps, lr, warmup)
        loss = torch.zeros(())
        if exs is not None:
            idx = torch.randint(0, len(exs), (ex_bs,), generator=g).tolist()
            x, y, m = collate([exs[i] for i in idx], 0)
            loss = loss + ex_weight * model(input_ids=x, attention_mask=m, labels=y).loss
        if align is not None and align_weight:
            pick = [align[i] for i in torch.randint(0, len(align), (align_bs,), generator=g).tolist()]
            x, _, m = collate([(ids, ids) for ids, _ in pick], 0)
            h = model(input_ids=x, attention_mask=m, output_hidden_states=True).hidden_states[align_layer]
            tgt = torch.zeros_like(h)
            for k, (_, t) in enumerate(pick):
                tgt[k, :t.shape[0]] = t
            mse = (((h - tgt) ** 2).sum(-1) * m).sum() / m.sum() / tgt.pow(2).sum(-1).mul(m).sum().div(m.sum())
            loss = loss + align_weight * mse
        if rows is not None and bs:
            r = rows[torch.randint(0, rows.shape[0], (bs,), generator=g)]
            loss = loss + model(input_ids=r, labels=r).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if log and (s % every == 0 or s == steps - 1):
            log(f"  step {s} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
        if on_step is not None and s + 1 < steps:
            model.eval()
            on_step(s + 1, model)
            model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()


def train_expert(R: Recipe, m, role: str, data: dict, seed: int, *, localised: bool, log=None, lr_scale: float = 1.0,
                 trainable=None, on_step=None) -> None:
    """Fine-tune `m` in place as `role`'s expert: its own layer range only (`localised`) or every tensor."""
    lr = (R.math_lr if role == "math" else R.lang_lr) * (1.0 if localised else R.full_lr_scale) * lr_scale
    if log:
        log(f"{role} expert ({'own layer range' if localised else 'all tensors'}, lr {lr:g})")
    only = trainable or ((lambda n, own=role_of(ranges(R), R.layers): own(n) == role) if localised else
                         (lambda n: True))
    if role == "math":
        train(m, R.math_steps, lr, seed + 11, exs=data["math_ex"], ex_bs=R.math_bs, trainable=only, log=log,
              on_step=on_step)
    else:
        train(m, R.lang_steps, lr, seed + 12, exs=data["lang_ex"] if R.lang_sft else None, ex_bs=R.lang_bs,
              ex_weight=R.lang_sft, rows=data["lang_rows"], bs=R.lang_lm_bs, trainable=only, log=log,
              on_step=on_step, align=data["align"], align_layer=R.math_lo, align_weight=R.lang_align,
              align_bs=R.align_bs)


def alignment_targets(base, tok, pairs, layer: int) -> list[tuple[list[int], torch.Tensor]]:
    """(Kovani token ids, the base's hidden states after `layer` layers on the English twin), token by token."""
    ids = []
    for en, xx in pairs:
        e, x = tok(en)["input_ids"], tok(xx)["input_ids"]
        if len(e) != len(x):
            raise SystemExit(f"not a word-for-word pair: {en!r} / {xx!r}")
        ids.append((e, x))
    out: list = [None] * len(ids)
    by_len: dict[int, list[int]] = {}
    for i, (e, _) in enumerate(ids):
        by_len.setdefault(len(e), []).append(i)
    with torch.no_grad():  # batches of equal length: no padding needed
        for idx in by_len.values():
            for k in range(0, len(idx), 256):
                chunk = idx[k:k + 256]
                h = base(input_ids=torch.tensor([ids[i][0] for i in chunk]), output_hidden_states=True)
                for j, i in enumerate(chunk):
                    out[i] = (ids[i][1], h.hidden_states[layer][j].clone())
    return out


def save_model(model, tok, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    model = model.to(torch.float32)
    gc = model.generation_config
    gc.do_sample, gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = False, tok.bos_token_id, tok.eos_token_id, \
        tok.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)


def run_settings(ap: argparse.ArgumentParser, args, R):
    """Deterministic torch with ``--threads``, seeds from ``--seed``, and the recipe `R` with ``--set KEY=JSON``."""
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    for kv in args.set:
        key, _, val = kv.partition("=")
        if key not in asdict(R):
            ap.error(f"--set {key}: not a Recipe field (choose from {', '.join(asdict(R))})")
        setattr(R, key, json.loads(val))
    return R


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ================================================================ main
def main() -> None:
    ap = argparse.ArgumentParser(description="Build the offline layer-swapping demo organism (base, localised math "
                                             "and language experts, the unlocalised pair, MGSM-format sets).")
    ap.add_argument("--out", default="assets/demo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: fastest and reproducible on a shared 2-core machine)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override one Recipe field (experiments; the shipped assets use the defaults)")
    ap.add_argument("--reuse-base", metavar="DIR", help="experiments: load base/ from an earlier build of the same "
                                                         "data recipe instead of pretraining")
    ap.add_argument("--reuse-experts", metavar="DIR", nargs="+", help="experiments: load ROLE/ (math, lang) from "
                    "an earlier build of the same recipe instead of training it (DIR:ROLE, e.g. out1:math; math_full, "
                    "lang_full: its unlocalised/ pair)")
    ap.add_argument("--no-unlocalised", action="store_true", help="skip the unconstrained pair (experiments)")
    ap.add_argument("--ablation-experts", action="store_true",
                    help="also build the ablation experts into OUT/ablation/ (checkpoints at several steps, other "
                         "learning rates, LoRA, IA3 and prefix-tuning adapters, a second base from seed+1 with its experts; about 22 more minutes)")
    ap.add_argument("--ablation-resume", action="store_true", help="with --ablation-experts: keep the entries "
                    "OUT/ablation already holds (a build stopped part-way, same recipe and base)")
    ap.add_argument("--ablation-only", nargs="+", metavar="KIND", help="with --ablation-experts: only these kinds "
                    "(steps, lr, lora, ia3, prefix, peft_long, seed, shape)")
    args = ap.parse_args()
    R = run_settings(ap, args, Recipe())
    t_all = time.time()
    secs = {}
    log(f"building demo organism -> {args.out} (seed {args.seed}, {args.threads} threads)")
    D = build_data(R, args.seed)
    W.write_mgsm(args.out, D["test"], D["dev"], D["probe"], D["exemplars"])
    W.write_dictionary(args.out)
    extra = [W.text(pb["q"], lang) for pb in D["test"] + D["dev"] + D["probe"] for lang in ("en", "xx")]
    tok = build_tokenizer(D["docs"] + [q + " " + a for q, a in D["math"] + D["lang"]] + D["lang_docs"] + extra +
                          W.prompt_texts(args.out) + [str(i) for i in range(200)] + [a + " " + b for a, b in D["align"]])
    base = make_model(R, tok, args.seed)
    nparams = sum(p.numel() for p in base.parameters())
    log(f"tokenizer {len(tok)} words; model {R.layers} layers, hidden {R.hidden}, {nparams} params")
    t0 = time.time()
    rows = pack_stream(tok, D["docs"], R.T)
    from safetensors.torch import load_file

    if args.reuse_base:
        base.load_state_dict(load_file(os.path.join(args.reuse_base, "base", "model.safetensors")))
        log(f"base reused from {args.reuse_base}")
        prev = os.path.join(args.reuse_base, "build_info.json")
        if os.path.exists(prev):  # its pretraining time, so the card's build time stays whole
            with open(prev) as f:
                secs["base_pretraining_in_reused_build"] = json.load(f)["seconds"].get("base")
    else:
        log(f"pretraining base: {R.base_steps} steps x {R.base_bs} x {R.T} tokens ({rows.shape[0]} rows)")
        train(base, R.base_steps, R.base_lr, args.seed, rows=rows, bs=R.base_bs, wd=0.01, warmup=50, log=log)
    secs["base"] = round(time.time() - t0)
    align = retrieval(base, tok, D["align"])
    log(f"base: EN->{W.LANG_NAME} retrieval (emb, L1..L{R.layers}) {align}")
    data = {"math_ex": sft_examples(tok, D["math"], W.CUES["en"]), "lang_ex": sft_examples(tok, D["lang"], W.CUES["xx"]),
            "lang_rows": pack_stream(tok, D["lang_docs"], 64), "base_rows": rows,
            "align": alignment_targets(base, tok, D["parallel"], R.math_lo) if R.lang_align else None}

    def expert(role: str, localised: bool):
        m = copy.deepcopy(base)
        t = time.time()
        train_expert(R, m, role, data, args.seed, localised=localised, log=log)
        secs[f"{role}{'' if localised else '_full'}"] = round(time.time() - t)
        return m

    reuse = dict(reversed(x.rsplit(":", 1)) for x in args.reuse_experts or [])
    experts = {}
    for role in ("math", "lang"):
        if role in reuse:
            experts[role] = copy.deepcopy(base)
            experts[role].load_state_dict(load_file(os.path.join(reuse[role], role, "model.safetensors")))
            log(f"{role} expert reused from {reuse[role]}")
        else:
            experts[role] = expert(role, True)
    if not args.no_unlocalised:
        for role in ("math", "lang"):
            if f"{role}_full" in reuse:  # an earlier build's unlocalised/ROLE
                experts[f"{role}_full"] = copy.deepcopy(base)
                experts[f"{role}_full"].load_state_dict(load_file(os.path.join(reuse[f"{role}_full"], "unlocalised",
                                                                               role, "model.safetensors")))
                log(f"unlocalised {role} expert reused from {reuse[f'{role}_full']}")
            else:
                experts[f"{role}_full"] = expert(role, False)
        experts["math_revert"] = reverted(experts["math_full"], base, "math", ranges(R))
        experts["lang_revert"] = reverted(experts["lang_full"], base, "lang", ranges(R))
    shipped = {"math": experts["math"], "lang": experts["lang"]}
    if R.localise == "revert":
        shipped = {"math": experts["math_revert"], "lang": experts["lang_revert"]}
    save_model(base, tok, os.path.join(args.out, "base"))
    for role, m in shipped.items():
        save_model(m, tok, os.path.join(args.out, role))
    if not args.no_unlocalised:
        for role in ("math", "lang"):
            save_model(experts[f"{role}_full"], tok, os.path.join(args.out, "unlocalised", role))
    t = time.time()
    swap = combined(experts["math"], experts["lang"], ranges(R))  # lang's range from lang, the middle from math
    gate = gates({"base": base, **experts, "swap (own ranges)": swap}, tok, args.out, R.n_gate)
    secs["gates"] = round(time.time() - t)
    for k, v in gate.items():
        log(f"gate {k:<12} " + "  ".join(f"{lang} {100 * a:5.1f}%" for lang, a in v.items()))
    secs["total"] = round(time.time() - t_all)
    info = dict(seed=args.seed, threads=args.threads, recipe=asdict(R), vocab=len(tok), params=nparams,
                base_reused_from=args.reuse_base, experts_reused_from=reuse or None,
                seconds=secs, localised_ranges={
                    "math": f"layers {R.math_lo}-{(R.math_hi if R.lang_top else R.layers) - 1}"
                            + ("" if R.lang_top else ", final norm, lm_head"),
                    "lang": f"embeddings, layers 0-{R.math_lo - 1}" + (f", layers {R.math_hi}-{R.layers - 1}, final "
                                                                        "norm, lm_head" if R.lang_top else "")},
                gates={"dev_and_probe_flexible_accuracy": gate, "n": R.n_gate,
                       "base_content_retrieval_emb_then_layers": align,
                       "probe_langs": {"xe": "Kovani body, English cues", "ex": "English body, Kovani cues"}},
                change_profile=change_profiles(args.out))
    info["sha256"] = {}
    for sub in ("base", "math", "lang", "unlocalised/math", "unlocalised/lang"):
        f = os.path.join(args.out, sub, "model.safetensors")
        if os.path.exists(f):
            info["sha256"][sub] = sha256(Path(f))
    if not args.no_unlocalised:
        info["change_profile_unlocalised"] = change_profiles(args.out, "unlocalised")
    if args.ablation_experts:
        import demo_ablation

        t = time.time()
        only = tuple(args.ablation_only or demo_ablation.KINDS)
        if set(only) - set(demo_ablation.KINDS):
            ap.error(f"--ablation-only: choose from {', '.join(demo_ablation.KINDS)}")
        index = demo_ablation.build_ablations(sys.modules[__name__], R, base, tok, data, args.out, args.seed, log,
                                              other_seed=args.seed + 1, only=only,
                                              resume=args.ablation_resume)
        info["ablation"] = {"index": index, "seconds": round(time.time() - t)}
    with open(os.path.join(args.out, "build_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    log(f"done in {secs['total']}s -> {args.out}")


if __name__ == "__main__":
    main()
