#!/usr/bin/env python
"""Build the offline layer-swapping "demo organism".

Creates a synthetic two-language world (English + the constructed language Kovani, code ``xx``), a word-level
tokenizer, a tiny LlamaForCausalLM base pretrained on generic text in both languages, a math expert (the base
fine-tuned on English arithmetic word problems) and a language expert (the base fine-tuned on Kovani instructions,
no math), plus MGSM-format test sets. Everything is deterministic given --seed.

Output layout (default --out assets/demo):
  base/ math/ lang/      HF model dirs (config.json, model.safetensors in float32, generation_config.json, tokenizer)
  mgsm/mgsm_en.tsv mgsm/mgsm_xx.tsv mgsm/exemplars.json mgsm/languages.json
  build_info.json        recipe, timings, base cross-lingual alignment, per-layer change profiles

Dependencies: torch, transformers, tokenizers, safetensors, numpy and layerswap (the change profiles). See
assets/demo/README.md.
"""
import argparse
import copy
import json
import math
import os
import random
import re
import sys
import time

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # layerswap, run from anywhere

# ================================================================ synthetic world
NAMES = ["Tom", "Mia", "Sam", "Ana", "Leo", "Eva", "Max", "Zoe", "Ben", "Lia", "Kai", "Ivy", "Noa", "Raj", "Emi", "Uma"]
OBJECTS = [("apples", "pomi"), ("books", "liru"), ("balls", "kuro"), ("cups", "tazo"), ("pens", "sefi"),
           ("stones", "kavu"), ("shells", "moko"), ("cards", "tarni"), ("eggs", "ovu"), ("flowers", "fiola"),
           ("coins", "munu"), ("toys", "jaki"), ("cakes", "tuka"), ("hats", "shapi"), ("keys", "kluvo"),
           ("boxes", "bokta")]
COLOURS = [("red", "ruva"), ("blue", "belo"), ("green", "vira"), ("yellow", "jelu"), ("white", "bia"),
           ("black", "nero"), ("pink", "roza"), ("brown", "buni")]
PLACES = [("park", "sadu"), ("kitchen", "kuhno"), ("school", "skola"), ("garden", "vrto"), ("shop", "duka"),
          ("library", "kitabo"), ("beach", "plazo"), ("room", "soba")]
GAIN = [("buys", "kopra"), ("finds", "nalo"), ("gets", "polu"), ("makes", "delo"), ("picks", "biro")]
LOSE = [("eats", "jama"), ("loses", "gubi"), ("sells", "proda"), ("breaks", "lomi")]
FUNC = {  # concept -> (en, xx); None = word absent in that language
    "has": ("has", "tenu"), "have": ("have", "tenu"), "gives": ("gives", "dava"), "is": ("is", "ese"),
    "likes": ("likes", "lubi"), "sees": ("sees", "vidu"), "plays": ("plays", "igra"), "wants": ("wants", "hoti"),
    "carries": ("carries", "nosi"), "asks": ("asks", "pita"), "knows": ("knows", "zna"), "goes": ("goes", "ide"),
    "reads": ("reads", "cita"), "paints": ("paints", "slika"), "more": ("more", "vise"), "to": ("to", "ne"),
    "in": ("in", "bo"), "with": ("with", "sa"), "and": ("and", "i"), "question": ("question", "sorvi"),
    "answer": ("answer", "danu"), "now": ("now", "sada"), "today": ("today", "danas"), "then": ("then", "pak"),
    "also": ("also", "tez"), "very": ("very", "vrlo"), "the": ("the", None), "a": ("a", None),
    "does": ("does", None), "howmany": ("How many", "kati"), "where": ("Where", "gde"), "who": ("Who", "ko"),
    "what": ("What", "kva"), "colour": ("colour", "boja"), "many": ("many", "mnogo"), "all": ("all", "sve"),
    "like": ("like", "lubi"), "want": ("want", "hoti"), "howmany_l": ("how many", "kati"), "happens": ("happens", "bivu"),
}
for en, xx in OBJECTS + COLOURS + PLACES + GAIN + LOSE:
    FUNC[en] = (en, xx)

LANG_NAME = "Kovani"
CUES = {
    "en": {"question": "Question:", "answer_cue": "Step-by-Step Answer:", "direct_cue": "Answer:",
           "answer_is": "The answer is", "name": "English"},
    "xx": {"question": "Sorvi:", "answer_cue": "Pasu-pasu Danu:", "direct_cue": "Danu:",
           "answer_is": "Danu ki", "name": LANG_NAME},
}
PUNCT = set(".,:?!")


def realise(seq, lang, p_switch=0.0, rng=None):
    """seq: list of concept keys / literal tokens (names, numbers, punctuation). Returns list of words."""
    out = []
    for c in seq:
        if c in FUNC:
            en, xx = FUNC[c]
            use = lang
            if p_switch and rng.random() < p_switch:
                use = "xx" if lang == "en" else "en"
            w = en if use == "en" else xx
            if w is None:
                continue
            out.extend(w.split())
        else:
            out.append(str(c))
    return out


def detok(words):
    s = ""
    for w in words:
        if w in PUNCT or w == "\n":
            s += w
        elif s == "" or s.endswith("\n"):
            s += w
        else:
            s += " " + w
    return s


# ---------------- sentence frames: each returns {"en": [...concepts], "xx": [...]} ----------------
def fr_has(P, n, O, **k):
    return {"en": [P, "has", n, O, "."], "xx": [P, O, n, "has", "."]}


def fr_gain(P, n, O, V, **k):
    return {"en": [P, V, n, "more", O, "."], "xx": [P, O, n, "more", V, "."]}


def fr_give(P, n, O, Q, **k):
    return {"en": [P, "gives", n, O, "to", Q, "."], "xx": [P, Q, "to", O, n, "gives", "."]}


def fr_lose(P, n, O, V, **k):
    return {"en": [P, V, n, O, "."], "xx": [P, O, n, V, "."]}


def fr_in(P, PL, **k):
    return {"en": [P, "is", "in", "the", PL, "."], "xx": [P, PL, "in", "is", "."]}


def fr_likes(P, C, O, **k):
    return {"en": [P, "likes", "the", C, O, "."], "xx": [P, O, C, "likes", "."]}


def fr_sees(P, n, C, O, PL, **k):
    return {"en": [P, "sees", n, C, O, "in", "the", PL, "."], "xx": [P, PL, "in", O, C, n, "sees", "."]}


def fr_plays(P, Q, PL, **k):
    return {"en": [P, "plays", "with", Q, "in", "the", PL, "."], "xx": [P, Q, "with", PL, "in", "plays", "."]}


def fr_wants(P, n, C, O, **k):
    return {"en": [P, "wants", n, C, O, "."], "xx": [P, O, C, n, "wants", "."]}


def fr_carries(P, O, PL, **k):
    return {"en": [P, "carries", "the", O, "to", "the", PL, "."], "xx": [P, PL, "to", O, "carries", "."]}


def fr_asks(P, Q, **k):
    return {"en": [P, "asks", Q, "a", "question", "."], "xx": [P, Q, "question", "asks", "."]}


def fr_knows(Q, **k):
    return {"en": [Q, "knows", "the", "answer", "."], "xx": [Q, "answer", "knows", "."]}


def fr_goes(P, PL, Q, **k):
    return {"en": [P, "goes", "to", "the", PL, "with", Q, "."], "xx": [P, Q, "with", PL, "to", "goes", "."]}


def fr_paints(P, O, C, **k):
    return {"en": [P, "paints", "the", O, C, "."], "xx": [P, O, C, "paints", "."]}


def fr_askcount(P, Q, O, **k):
    return {"en": [P, "asks", ":", "howmany", O, "does", Q, "have", "now", "?"],
            "xx": [P, "asks", ":", Q, "now", O, "howmany", "has", "?"]}


def fr_now_in(P, PL, **k):
    return {"en": [P, "is", "in", "the", PL, "now", "."], "xx": [P, "now", PL, "in", "is", "."]}


FRAMES_EXTRA = [fr_askcount, fr_now_in]

FRAMES = [fr_has, fr_gain, fr_give, fr_lose, fr_in, fr_likes, fr_sees, fr_plays, fr_wants, fr_carries,
          fr_asks, fr_knows, fr_goes, fr_paints]


class World:
    def __init__(self, seed, nmax=20, p_vary=0.3, p_prof=0.0):
        self.rng = random.Random(seed)
        self.nmax = nmax
        self.p_vary = p_vary
        self.p_prof = p_prof
        self.restate = False
        self.frames = list(FRAMES)
        self.instr_kinds = ["where", "who", "colour", "count", "translate", "what"]
        self.amax = 20
        pr = random.Random(12345)  # fixed "semantics" of the world: selectional preferences
        self.prof = {}
        for o, _ in OBJECTS:
            self.prof[o] = dict(C=pr.sample([c for c, _ in COLOURS], 2), PL=pr.sample([p for p, _ in PLACES], 2),
                                G=pr.sample([g for g, _ in GAIN], 2), Lo=pr.sample([l for l, _ in LOSE], 2))
        self.name_place = {n: pr.choice([p for p, _ in PLACES]) for n in NAMES}

    def _pick(self, O, key, pool):
        if self.p_prof and self.rng.random() < self.p_prof:
            return self.rng.choice(self.prof[O][key])
        return self.rng.choice(pool)[0]

    def cast(self):
        r = self.rng
        P, Q = r.sample(NAMES, 2)
        O = r.choice(OBJECTS)[0]
        return dict(P=P, Q=Q, O=O, C=self._pick(O, "C", COLOURS), PL=self._pick(O, "PL", PLACES))

    def sentence(self, cast, frame=None):
        r = self.rng
        slots = dict(cast)
        pv = self.p_vary
        if r.random() < pv:  # occasionally another object/colour/place
            slots["O"] = r.choice(OBJECTS)[0]
            slots["C"] = self._pick(slots["O"], "C", COLOURS)
        if r.random() < pv:
            slots["PL"] = self._pick(slots["O"], "PL", PLACES)
        if r.random() < pv:
            slots["C"] = self._pick(slots["O"], "C", COLOURS)
        if r.random() < 0.25:
            slots["P"], slots["Q"] = slots["Q"], slots["P"]
        slots["n"] = r.randint(1, self.nmax)
        frame = frame or r.choice(self.frames)
        if frame is fr_gain:
            slots["V"] = self._pick(slots["O"], "G", GAIN)
        elif frame is fr_lose:
            slots["V"] = self._pick(slots["O"], "Lo", LOSE)
        return frame(**slots)

    # ---- pretraining documents ----
    def story_doc(self, mode, nsent, p_switch=0.3, p_xx=0.5):
        """mode: en | xx | mix (sentence-level code-switching) | cs (word-level switching) | par (parallel)."""
        r = self.rng
        cast = self.cast()
        words = []
        for _ in range(nsent):
            s = self.sentence(cast)
            if mode in ("en", "xx"):
                words += realise(s[mode], mode)
            elif mode == "mix":
                lang = "xx" if r.random() < p_xx else "en"
                words += realise(s[lang], lang)
            elif mode == "cs":
                lang = "xx" if r.random() < p_xx else "en"
                words += realise(s[lang], lang, p_switch, r)
            elif mode == "par":
                first = "xx" if r.random() < 0.5 else "en"
                second = "en" if first == "xx" else "xx"
                words += realise(s[first], first) + realise(s[second], second)
        return detok(words)

    def arith_doc(self, k=4, amax=20, bmax=None):
        r = self.rng
        parts = []
        for _ in range(k):
            a, b = r.randint(0, amax), r.randint(0, bmax if bmax is not None else amax)
            if r.random() < 0.5:
                parts.append(f"{a} + {b} = {a + b}.")
            else:
                a, b = max(a, b), min(a, b)
                parts.append(f"{a} - {b} = {a - b}.")
        return " ".join(parts)

    # ---- math word problems ----
    def math_problem(self, steps=None, amax=20, bmax=10):
        r = self.rng
        steps = steps or r.choice([1, 2])
        P, Q = r.sample(NAMES, 2)
        O = r.choice(OBJECTS)[0]
        a = r.randint(2, amax)
        sents = [fr_has(P=P, n=a, O=O)]
        eqs = []
        cur = a
        ops = []
        for _ in range(steps):
            kind = r.choice(["gain", "lose", "give"])
            if kind != "gain" and cur == 0:
                kind = "gain"
            if kind == "gain":
                b = r.randint(1, bmax)
                sents.append(fr_gain(P=P, n=b, O=O, V=r.choice(GAIN)[0]))
                eqs.append((cur, "+", b, cur + b))
                cur += b
            else:
                b = r.randint(1, min(bmax, cur))
                if kind == "lose":
                    sents.append(fr_lose(P=P, n=b, O=O, V=r.choice(LOSE)[0]))
                else:
                    sents.append(fr_give(P=P, n=b, O=O, Q=Q))
                eqs.append((cur, "-", b, cur - b))
                cur -= b
            ops.append(kind)
        q = {"en": ["howmany", O, "does", P, "have", "now", "?"], "xx": [P, "now", O, "howmany", "has", "?"]}
        key = (P, O, a, tuple(e[1:3] for e in eqs))
        return dict(sents=sents, q=q, eqs=eqs, ans=cur, P=P, O=O, a=a, key=key)

    def render_problem(self, pb, lang):
        qw = []
        for s in pb["sents"]:
            qw += realise(s[lang], lang)
        qw += realise(pb["q"][lang], lang)
        aw = realise(pb["sents"][0][lang], lang)
        for s, (x, op, y, z) in zip(pb["sents"][1:], pb["eqs"]):
            if self.restate:
                aw += realise(s[lang], lang)
            aw += [str(x), op, str(y), "=", str(z), "."]
        aw += CUES[lang]["answer_is"].split() + [str(pb["ans"]), "."]
        eq = " ".join(f"{x} {op} {y} = {z}." for (x, op, y, z) in pb["eqs"])
        return detok(qw), detok(aw), eq

    # ---- generic instructions in a language (no arithmetic) ----
    def instruction(self, lang="xx"):
        r = self.rng
        cast = self.cast()
        P, Q, O, C, PL = cast["P"], cast["Q"], cast["O"], cast["C"], cast["PL"]
        kind = r.choice(self.instr_kinds)
        ans_is = CUES[lang]["answer_is"].split()
        if kind == "where":
            ctx = [fr_in(P=P, PL=PL), fr_likes(P=Q, C=C, O=O)]
            r.shuffle(ctx)
            q = {"en": ["where", "is", P, "?"], "xx": [P, "where", "is", "?"]}
            a_s, a_w = fr_in(P=P, PL=PL), PL
        elif kind == "who":
            ctx = [fr_plays(P=P, Q=Q, PL=PL), fr_has(P=P, n=r.randint(1, self.nmax), O=O)]
            r.shuffle(ctx)
            q = {"en": ["who", "plays", "with", P, "?"], "xx": [P, "with", "who", "plays", "?"]}
            a_s, a_w = fr_plays(P=Q, Q=P, PL=PL), Q
        elif kind == "colour":
            ctx = [fr_likes(P=P, C=C, O=O), fr_in(P=Q, PL=PL)]
            r.shuffle(ctx)
            q = {"en": ["what", "colour", "does", P, "like", "?"], "xx": [P, "what", "colour", "likes", "?"]}
            a_s, a_w = fr_likes(P=P, C=C, O=O), C
        elif kind == "count":
            n = r.randint(1, self.nmax)
            ctx = [fr_has(P=P, n=n, O=O), fr_in(P=P, PL=PL)]
            r.shuffle(ctx)
            q = {"en": ["howmany", O, "does", P, "have", "?"], "xx": [P, O, "howmany", "has", "?"]}
            a_s, a_w = fr_has(P=P, n=n, O=O), n
        elif kind == "what":
            n = r.randint(1, self.nmax)
            ctx = [fr_wants(P=P, n=n, C=C, O=O), fr_goes(P=P, PL=PL, Q=Q)]
            r.shuffle(ctx)
            q = {"en": ["what", "does", P, "want", "?"], "xx": [P, "what", "wants", "?"]}
            a_s, a_w = fr_wants(P=P, n=n, C=C, O=O), O
        elif kind == "retell":
            ctx = [self.sentence(cast) for _ in range(r.randint(2, 3))]
            qw = []
            for s in ctx:
                qw += realise(s[lang], lang)
            qw += realise(["what", "happens", "?"], lang)
            aw = []
            for s in ctx:
                aw += realise(s[lang], lang)
            return detok(qw), detok(aw)
        else:  # translate an English sentence into the language
            s = self.sentence(cast)
            src = realise(s["en"], "en")
            qw = ["Kovani", "ne", "prevodi", ":"] + src
            aw = realise(s[lang], lang)
            return detok(qw), detok(aw)
        qw = []
        for s in ctx:
            qw += realise(s[lang], lang)
        qw += realise(q[lang], lang)
        aw = realise(a_s[lang], lang) + ans_is + [FUNC[a_w][0 if lang == "en" else 1] if a_w in FUNC else str(a_w), "."]
        return detok(qw), detok(aw)


def qa_doc(world, lang, count_qa=False, p_cue_switch=0.0, rng=None, numbers=True):
    """Generic (non-arithmetic) reading-comprehension Q&A document in the MGSM-like format.

    Translation items are left out of the base. Items whose answer is a number copied from the context
    ("count") are left out unless `count_qa`. With `p_cue_switch` the Question/Answer cues come from the
    other language (format-level code-switching). Without `numbers`, answers never contain a digit.
    """
    while True:
        q, a = world.instruction(lang)
        last = a.split()[-1].rstrip(".")
        if (last.isdigit() and not count_qa) or "prevodi" in q or (not numbers and re.search(r"\d", a)):
            continue
        cue_lang = lang
        if p_cue_switch and rng.random() < p_cue_switch:
            cue_lang = "xx" if lang == "en" else "en"
        c = CUES[cue_lang]
        return c["question"] + " " + q + "\n" + c["answer_cue"] + " " + a


def ledger_doc(world, lang, keys):
    """Narrative running count with inline arithmetic, NO question / answer (e.g. 'Raj sells 7 eggs. 18 - 7 = 11.')."""
    while True:
        pb = world.math_problem()
        if pb["key"] not in keys:
            break
    words = realise(pb["sents"][0][lang], lang)
    for s, (x, op, y, z) in zip(pb["sents"][1:], pb["eqs"]):
        words += realise(s[lang], lang) + [str(x), op, str(y), "=", str(z), "."]
    return detok(words)


# ================================================================ tokenizer, model, training
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def make_pretok():
    return pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True),
        pre_tokenizers.Split(Regex(r"[.,:?!\n]"), behavior="isolated")])


def build_tokenizer(texts):
    pt = make_pretok()
    words = set()
    for t in texts:
        for w, _ in pt.pre_tokenize_str(t):
            words.add(w)
    vocab = {t: i for i, t in enumerate(SPECIALS + sorted(words))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pt
    tk.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", clean_up_tokenization_spaces=False)
    return fast


def make_model(vocab_size, tok, layers=10, hidden=128, inter=320, heads=2, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      head_dim=hidden // heads, max_position_embeddings=512, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, initializer_range=0.02)
    m = LlamaForCausalLM(cfg)
    return m


# ---------------------------------------------------------------- training


def lr_at(step, total, lr, warmup, min_ratio=0.1):
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def pack_stream(tok, docs, T):
    ids = []
    for d in docs:
        ids += [tok.bos_token_id] + tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = len(ids) // T
    return torch.tensor(ids[: n * T]).view(n, T)


def train_lm(model, rows, steps, bs, lr, seed, wd=0.01, warmup=50, log=None, log_every=100, betas=(0.9, 0.98),
             cb=None, cb_every=0):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=betas)
    model.train()
    t0 = time.time()
    for s in range(steps):
        for pg in opt.param_groups:
            pg["lr"] = lr_at(s, steps, lr, warmup)
        idx = torch.randint(0, rows.shape[0], (bs,), generator=g)
        x = rows[idx]
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if log and (s % log_every == 0 or s == steps - 1):
            log(f"  step {s} loss {out.loss.item():.3f} ({time.time() - t0:.0f}s)")
        if cb and cb_every and (s + 1) % cb_every == 0 and s + 1 < steps:
            model.eval()
            cb(s + 1)
            model.train()
    model.eval()


def sft_examples(tok, pairs, lang, answer_only=True):
    """pairs: (question_text, answer_text). Returns list of (ids, labels)."""
    c = CUES[lang]
    ex = []
    for q, a in pairs:
        p = tok(c["question"] + " " + q + "\n" + c["answer_cue"], add_special_tokens=False)["input_ids"]
        t = tok(" " + a, add_special_tokens=False)["input_ids"]
        ids = [tok.bos_token_id] + p + t + [tok.eos_token_id]
        lab = ([-100] * (1 + len(p)) if answer_only else [-100] + p) + t + [tok.eos_token_id]
        ex.append((ids, lab))
    return ex


def collate(exs, pad):
    T = max(len(i) for i, _ in exs)
    x = torch.full((len(exs), T), pad)
    y = torch.full((len(exs), T), -100)
    m = torch.zeros((len(exs), T), dtype=torch.long)
    for k, (i, l) in enumerate(exs):
        x[k, :len(i)] = torch.tensor(i)
        y[k, :len(l)] = torch.tensor(l)
        m[k, :len(i)] = 1
    return x, y, m


def train_sft(model, exs, steps, bs, lr, seed, wd=0.0, warmup=20, log=None, log_every=100, opt_name="adam",
              mix_rows=None, mix_bs=0, betas=(0.9, 0.98), min_ratio=0.1):
    g = torch.Generator().manual_seed(seed)
    if opt_name == "adam":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=betas)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model.train()
    t0 = time.time()
    for s in range(steps):
        for pg in opt.param_groups:
            pg["lr"] = lr_at(s, steps, lr, warmup, min_ratio)
        idx = torch.randint(0, len(exs), (bs,), generator=g).tolist()
        x, y, m = collate([exs[i] for i in idx], 0)
        out = model(input_ids=x, attention_mask=m, labels=y)
        loss = out.loss
        if mix_rows is not None and mix_bs:
            j = torch.randint(0, mix_rows.shape[0], (mix_bs,), generator=g)
            r = mix_rows[j]
            loss = loss + model(input_ids=r, labels=r).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if log and (s % log_every == 0 or s == steps - 1):
            log(f"  step {s} loss {out.loss.item():.3f} ({time.time() - t0:.0f}s)")
    model.eval()


# ---------------------------------------------------------------- change profile
NON_LAYER = {"emb": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}


def change_profiles(out):
    """Relative change ||expert - base|| / ||base|| per layer and per non-layer tensor, by layerswap's analysis."""
    from layerswap import Checkpoint
    from layerswap.analysis import analyze

    cks = {r: Checkpoint.open(os.path.join(out, r)) for r in ("base", "math", "lang")}
    an = analyze(cks["base"], cks["math"], cks["lang"], cache=False)
    rows = {r["tensor"]: r for r in an.non_layer_rows()}
    return {role: [[round(float(x), 4) for x in an.layer_profile(role)],
                   {k: round(float(rows[t][f"relative_{role}"]), 4) for k, t in NON_LAYER.items()}]
            for role in ("math", "lang")}


# ---------------------------------------------------------------- alignment


def hidden_means(model, tok, sents):
    reps = None
    for s in sents:
        ids = torch.tensor([[tok.bos_token_id] + tok(s, add_special_tokens=False)["input_ids"]])
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        v = [h[0, 1:].mean(0) for h in hs]
        if reps is None:
            reps = [[] for _ in v]
        for k, x in enumerate(v):
            reps[k].append(x)
    return [torch.stack(r) for r in reps]


def retrieval(model, tok, pairs):
    en = hidden_means(model, tok, [a for a, _ in pairs])
    xx = hidden_means(model, tok, [b for _, b in pairs])
    acc = []
    for E, X in zip(en, xx):
        E = E - E.mean(0)
        X = X - X.mean(0)
        E = E / E.norm(dim=1, keepdim=True)
        X = X / X.norm(dim=1, keepdim=True)
        sim = E @ X.T
        acc.append(round((sim.argmax(1) == torch.arange(len(pairs))).float().mean().item(), 3))
    return acc


# ================================================================ recipe
RECIPE = dict(
    layers=10, hidden=128, inter=320, heads=2,
    n_docs=60000, T=128, base_steps=1500, base_bs=16, base_lr=3e-3, base_wd=0.01,
    mix=dict(en=0.18, xx=0.05, mix=0.12, cs=0.30, par=0.12, arith=0.15, qa_en=0.06, qa_xx=0.02),
    p_switch=0.5, p_vary=0.1, p_prof=0.85, arith_range=(30, 10), nsent=(2, 5),
    n_math=20000, math_steps=600, math_bs=32, math_lr=3e-4,
    n_lang=20000, lang_steps=400, lang_bs=32, lang_lr=2e-4,
    replay_bs=4, n_test=300, n_align=200, n_exemplars=8,
    base_count_qa=False, qa_cue_switch=0.0, base_qa_numbers=False, retell=False, extra_frames=False,
)


def unseen_problems(world, n, keys):
    """`n` new word problems whose key (name, object, numbers, operations) is not in `keys`; adds their keys."""
    out = []
    while len(out) < n:
        pb = world.math_problem()
        if pb["key"] in keys:
            continue
        keys.add(pb["key"])
        out.append(pb)
    return out


def build_data(R, seed):
    w = World(seed, p_vary=R["p_vary"], p_prof=R["p_prof"])
    w.restate = True  # step-by-step answers restate each event sentence before its equation
    if R["retell"]:  # a generic "What happens?" instruction: restate the context sentences
        w.instr_kinds = w.instr_kinds + ["retell"]
    if R["extra_frames"]:  # reported "How many ... now?" questions and "now" in ordinary narrative
        w.frames = FRAMES + FRAMES_EXTRA
    keys = set()
    test = unseen_problems(w, R["n_test"], keys)
    align_rng = World(seed + 777, p_vary=R["p_vary"], p_prof=R["p_prof"])
    for _ in range(R["n_align"]):  # (keeps the random stream identical to the experiments)
        align_rng.sentence(align_rng.cast())
    align_c, seen = [], set()
    while len(align_c) < R["n_align"]:
        c = align_rng.cast()
        c["P"], c["Q"] = "Tom", "Mia"
        s = align_rng.sentence(c)
        e = [("7" if x.isdigit() else x) for x in realise(s["en"], "en")]
        x = [("7" if y.isdigit() else y) for y in realise(s["xx"], "xx")]
        if "Tom" not in e or "Mia" in e and e.index("Mia") < e.index("Tom"):
            continue
        e, x = detok(e), detok(x)
        if e in seen:
            continue
        seen.add(e)
        align_c.append((e, x))
    mix = R["mix"]
    kinds = list(mix)
    probs = [mix[k] for k in kinds]
    docs = []
    r = random.Random(seed + 1)
    for _ in range(R["n_docs"]):
        k = r.choices(kinds, probs)[0]
        if k == "arith":
            docs.append(w.arith_doc(r.randint(3, 6), *R["arith_range"]))
        elif k.startswith("ledger_"):
            docs.append(ledger_doc(w, k[7:], keys))
        elif k.startswith("qa_"):
            docs.append(qa_doc(w, k[3:], R["base_count_qa"], R["qa_cue_switch"], r, R["base_qa_numbers"]))
        else:
            docs.append(w.story_doc(k, r.randint(*R["nsent"]), p_switch=R["p_switch"]))
    math_pairs = []
    while len(math_pairs) < R["n_math"]:
        pb = w.math_problem()
        if pb["key"] in keys:
            continue
        q, a, _ = w.render_problem(pb, "en")
        math_pairs.append((q, a))
    lang_pairs = [w.instruction("xx") for _ in range(R["n_lang"])]
    exemplars = unseen_problems(w, R["n_exemplars"], keys)
    return dict(world=w, docs=docs, math=math_pairs, lang=lang_pairs, test_pb=test, align_c=align_c,
                exemplars=exemplars)


# ---------------------------------------------------------------- writing outputs
def save_model(model, tok, path):
    os.makedirs(path, exist_ok=True)
    model = model.to(torch.float32)
    model.generation_config.do_sample = False
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)


def write_mgsm(world, test_pb, exemplar_pb, out):
    d = os.path.join(out, "mgsm")
    os.makedirs(d, exist_ok=True)
    for lang in ("en", "xx"):
        with open(os.path.join(d, f"mgsm_{lang}.tsv"), "w", encoding="utf-8") as f:
            for pb in test_pb:
                q, _, _ = world.render_problem(pb, lang)
                f.write(f"{q}\t{pb['ans']}\n")
    ex = {}
    for lang in ("en", "xx"):
        c = CUES[lang]
        ex[lang] = []
        for pb in exemplar_pb:
            q, a, eq = world.render_problem(pb, lang)
            ex[lang].append({"question": c["question"] + " " + q, "answer": c["answer_cue"] + " " + a,
                             "answer_number": pb["ans"], "equation_solution": eq})
    with open(os.path.join(d, "exemplars.json"), "w", encoding="utf-8") as f:
        json.dump(ex, f, ensure_ascii=False, indent=1)
    langs = {}
    for lang in ("xx", "en"):
        c = CUES[lang]
        langs[lang] = {"name": c["name"], "question": c["question"], "answer_cue": c["answer_cue"],
                       "direct_cue": c["direct_cue"], "strict_regex": c["answer_is"] + " (\\-?[0-9\\.\\,]+)"}
    with open(os.path.join(d, "languages.json"), "w", encoding="utf-8") as f:
        json.dump(langs, f, ensure_ascii=False, indent=1)


# ================================================================ main
def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main():
    ap = argparse.ArgumentParser(description="Build the offline layer-swapping demo organism (base, math expert, "
                                             "language expert, MGSM-format test sets).")
    ap.add_argument("--out", default="assets/demo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps-scale", type=float, default=1.0,
                    help="multiply all training step counts (smoke tests only; the shipped assets use 1.0)")
    ap.add_argument("--reuse-base", metavar="DIR", help="experiments: take base/ from an earlier build instead of "
                                                         "pretraining (same data recipe required)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override one RECIPE entry (experiments; the shipped assets use the defaults)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    R = dict(RECIPE)
    for kv in args.set:
        key, _, val = kv.partition("=")
        if key not in R:
            ap.error(f"--set {key}: not a RECIPE key (choose from {', '.join(R)})")
        R[key] = json.loads(val)
    for k in ("base_steps", "math_steps", "lang_steps"):
        R[k] = max(1, int(round(R[k] * args.steps_scale)))
    t_all = time.time()
    log(f"building demo organism -> {args.out} (seed {args.seed}, {args.threads} threads)")
    D = build_data(R, args.seed)
    w = D["world"]
    log(f"world: {len(D['docs'])} pretraining docs, {len(D['math'])} math SFT, {len(D['lang'])} {LANG_NAME} SFT, "
        f"{len(D['test_pb'])} test problems")
    test_text = [w.render_problem(pb, l)[0] for pb in D["test_pb"] + D["exemplars"] for l in ("en", "xx")]
    cue_texts = [v for c in CUES.values() for v in (c["question"], c["answer_cue"], c["direct_cue"], c["answer_is"])]
    tok = build_tokenizer(D["docs"] + [q + " " + a for q, a in D["math"] + D["lang"]] + test_text + cue_texts +
                          [str(i) for i in range(200)] + [a + " " + b for a, b in D["align_c"]])
    log(f"tokenizer: {len(tok)} word-level tokens")
    L = R["layers"]
    base = make_model(len(tok), tok, L, R["hidden"], R["inter"], R["heads"], seed=args.seed)
    log(f"model: LlamaForCausalLM {L} layers, hidden {R['hidden']}, {R['heads']} heads (head_dim "
        f"{R['hidden'] // R['heads']}), {sum(p.numel() for p in base.parameters())} params")
    t0 = time.time()
    if args.reuse_base:  # experiments on the experts only: the base must come from the same data recipe
        from safetensors.torch import load_file

        if json.load(open(os.path.join(args.reuse_base, "base", "tokenizer.json")))["model"]["vocab"] != \
                json.loads(tok.backend_tokenizer.to_str())["model"]["vocab"]:
            raise SystemExit(f"--reuse-base {args.reuse_base}: its vocabulary differs (built from another data recipe)")
        base.load_state_dict(load_file(os.path.join(args.reuse_base, "base", "model.safetensors")))
        log(f"base reused from {args.reuse_base} (not retrained)")
    else:
        rows = pack_stream(tok, D["docs"], R["T"])
        log(f"pretraining base: {R['base_steps']} steps x {R['base_bs']} x {R['T']} tokens")
        train_lm(base, rows, R["base_steps"], R["base_bs"], R["base_lr"], args.seed, wd=R["base_wd"], log=log,
                 log_every=250)
    t_base = time.time() - t0
    align = retrieval(base, tok, D["align_c"])
    log(f"base done in {t_base:.0f}s; EN->{LANG_NAME} content retrieval top-1 (emb, L1..L{L}): {align}")
    replay = pack_stream(tok, D["docs"][:20000], R["T"])

    def expert(role, lang, seed, what):
        """The base fine-tuned on `role`'s pairs (answer-only loss, plus replayed pretraining rows)."""
        m = copy.deepcopy(base)
        t = time.time()
        log(f"{what}: {R[role + '_steps']} steps, lr {R[role + '_lr']} (answer-only loss + replay)")
        train_sft(m, sft_examples(tok, D[role], lang), R[role + "_steps"], R[role + "_bs"], R[role + "_lr"], seed,
                  log=log, log_every=100, mix_rows=replay, mix_bs=R["replay_bs"])
        return m, time.time() - t

    math_m, t_math = expert("math", "en", args.seed + 11, "math expert: English word problems")
    lang_m, t_lang = expert("lang", "xx", args.seed + 12, f"language expert: {LANG_NAME} instructions (no math)")
    for name, m in (("base", base), ("math", math_m), ("lang", lang_m)):
        save_model(m, tok, os.path.join(args.out, name))
    write_mgsm(w, D["test_pb"], D["exemplars"], args.out)
    info = dict(seed=args.seed, threads=args.threads, recipe=R, vocab=len(tok),
                params=sum(p.numel() for p in base.parameters()),
                seconds=dict(base=round(t_base), math=round(t_math), lang=round(t_lang),
                             total=round(time.time() - t_all)),
                base_content_retrieval=align,
                change_profile=change_profiles(args.out))
    with open(os.path.join(args.out, "build_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    log(f"done in {time.time() - t_all:.0f}s -> {args.out}/{{base,math,lang,mgsm}}")


if __name__ == "__main__":
    main()
