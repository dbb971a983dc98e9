"""Three ciphers of English, the target languages of the family organism (``assets/demo3``).

Each language is a word-level cipher of English in the manner of Kovani (``demo_world.py``): one word of its own
for every English word of the world (its cues and its answer phrase included), the same word order, names, digits
and punctuation shared. The three differ in their lexicons only, each drawn from a sound system of its own, so a
model that reads one has learnt nothing of the others' words:

    en  Raj has 18 eggs. Raj sells 7 eggs. How many eggs does Raj have now?
    qa  Raj kumu 18 patu. Raj manuku 7 patu. Luku kanutu patu nutu Raj puku nalu?     (Amuli)
    qb  Raj seszor 18 zorrer. Raj rorvo 7 zorrer. Sezo bodo zorrer sorve Raj vedeger gosgero?     (Beroshe)

The lexicons are drawn from a fixed seed per language (``random.Random("demo3-" + code)``), never from the build's
--seed, so every build has the same languages. Everything here is pure Python; the training lives in
``build_demo3.py``.
"""

from __future__ import annotations

import json
import os
import random
import re

import demo_world as W

# code -> (name, onsets, vowels, codas): each language's sound system
SOUNDS = {"qa": ("Amuli", "ptkmnl", "aiu", ""), "qb": ("Beroshe", "bdgrsvz", "eo", "rs"),
          "qc": ("Chiwanu", "hjwfy", "aeiou", "n")}
CODES = tuple(SOUNDS)
EXTRA = ["question", "answer", "step-by-step", "user", "assistant"]  # the cue words
ENGLISH = sorted({w.lower() for w in W.LEX if w not in ("Kovani", "Translate", "into")} | set(EXTRA))
EN_CUES = W.CUES["en"]
CHAT_EN = {"question": "User:", "answer_cue": "Assistant:"}


def _lexicon(code: str) -> dict[str, str]:
    """English word (lower case) -> this language's word: 2-3 syllables of its sound system, never an English word,
    a name or a word of another cipher (those end with a syllable of their own sound system)."""
    _, onsets, vowels, codas = SOUNDS[code]
    rng = random.Random(f"demo3-{code}")
    taken = {w.lower() for w in W.LEX} | {n.lower() for n in W.NAMES}
    out: dict[str, str] = {}
    for en in ENGLISH:
        while True:
            syl = [rng.choice(onsets) + rng.choice(vowels) + (rng.choice(codas) if codas and rng.random() < 0.3
                                                               else "") for _ in range(rng.choice([2, 2, 3]))]
            w = "".join(syl)
            if w not in taken:
                taken.add(w)
                out[en] = w
                break
    return out


LEXICONS = {code: _lexicon(code) for code in CODES}


def word(w: str, code: str) -> str:
    """One English word in `code` (same capitalisation); names, digits, punctuation and unknown words unchanged."""
    if code == "en":
        return w
    c = LEXICONS[code].get(w.lower())
    if c is None:
        return w
    return c[:1].upper() + c[1:] if w[:1].isupper() else c


def answer_is(code: str) -> str:
    return " ".join(word(w, code) for w in EN_CUES["answer_is"].split())


def realise(words: list[str], code: str) -> list[str]:
    out = []
    for w in words:
        out += answer_is(code).split() if w == W.ANSWER else [word(w, code)]
    return out


def text(words: list[str], code: str) -> str:
    """English world words -> text in English or one of the ciphers."""
    return W.detok(realise(words, code))


def cues(code: str) -> dict:
    """The MGSM prompt's cues in `code`, word for word from English's."""
    if code == "en":
        return dict(EN_CUES)
    tr = lambda s: " ".join(word(w, code) for w in s.rstrip(":").split()) + ":"  # noqa: E731
    return {"name": SOUNDS[code][0], "question": tr(EN_CUES["question"]), "answer_cue": tr(EN_CUES["answer_cue"]),
            "direct_cue": tr(EN_CUES["direct_cue"]), "answer_is": answer_is(code)}


def chat(code: str) -> dict:
    """The chat template of generic instructions (never the evaluation's cues) in `code`."""
    if code == "en":
        return dict(CHAT_EN)
    return {k: word(v.rstrip(":"), code) + ":" for k, v in CHAT_EN.items()}


def language_entry(code: str) -> dict:
    c = cues(code)
    return {k: c[k] for k in ("name", "question", "answer_cue", "direct_cue")} | {
        "strict_regex": re.escape(c["answer_is"]) + " (\\-?[0-9\\.\\,]+)"}


def instruction(world: W.World) -> tuple[list[str], list[str]]:
    """A generic instruction without arithmetic (English world words): reading comprehension or retelling."""
    while True:
        q, a = world.instruction()
        if q[0] != "Translate":
            return q, a


def parallel(words: list[str], code: str) -> str:
    """The English text, then the same text in `code` (parallel text)."""
    return text(words, "en") + "\n" + text(words, code)


def write_mgsm(out: str, test: list[dict], dev: list[dict], exemplars: list[dict]) -> None:
    """mgsm/ (test), mgsm/dev/ (plan choice), exemplars and languages, in English and every cipher: the same
    problems in each language, as MGSM's are."""
    d = os.path.join(out, "mgsm")
    codes = ("en", *CODES)
    langs = {code: language_entry(code) for code in codes}
    for sub, pbs in (("", test), ("dev", dev)):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
        for code in codes:
            with open(os.path.join(d, sub, f"mgsm_{code}.tsv"), "w", encoding="utf-8") as f:
                f.writelines(f"{text(pb['q'], code)}\t{pb['ans']}\n" for pb in pbs)
        with open(os.path.join(d, sub, "languages.json"), "w", encoding="utf-8") as f:
            json.dump(langs, f, ensure_ascii=False, indent=1)
    ex = {code: [{"question": langs[code]["question"] + " " + text(pb["q"], code),
                  "answer": langs[code]["answer_cue"] + " " + text(W.World.solution(pb), code),
                  "answer_number": pb["ans"],
                  "equation_solution": " ".join(f"{x} {op} {y} = {z}." for x, op, y, z in pb["eqs"])}
                 for pb in exemplars] for code in codes}
    with open(os.path.join(d, "exemplars.json"), "w", encoding="utf-8") as f:
        json.dump(ex, f, ensure_ascii=False, indent=1)


def write_dictionary(out: str) -> dict[str, dict[str, str]]:
    """``dictionary.json``: per language code, each English word's cipher word (the whole language)."""
    with open(os.path.join(out, "dictionary.json"), "w", encoding="utf-8") as f:
        json.dump(LEXICONS, f, ensure_ascii=False, indent=1)
    return LEXICONS
