"""Oruki (code ``yy``), the target language of the demo organism in the paper's setting.

It shares the world of ``demo_world.py`` (the same cast, objects, stories and word problems, generated
in English words there) but not English's grammar: clauses are verb-final (subject, objects, then the
verb), numbers and adjectives follow their noun, nouns take a plural suffix unless their number is 1,
case suffixes replace the prepositions (``-ne`` to, ``-bo`` in, ``-sa`` with, ``-ke`` into a colour),
and every verb agrees with its subject's noun class (names of class A take ``-a``, class B ``-o``).
So a word-for-word dictionary does not turn an Oruki problem into an English one. Names and digits
are shared, as between real languages. Example:

    Raj has 18 eggs. Raj sells 7 eggs. How many eggs does Raj have now?
    Raj ovu-ni 18 ten-o. Raj ovu-ni 7 prod-o. Sada Raj ovu-ni kazu ten-o?

The answer phrase is ``Danu N ki.`` ("answer N is"). Suffixes are written with a hyphen and are tokens of
their own (`build_demo2.py`'s tokenizer splits them off).
"""

from __future__ import annotations

import json
import os
import random

import demo_world as W

CODE, NAME = "yy", "Oruki"
OBJECTS = {**W.OBJECTS, "apples": "pom"}  # Kovani's nouns, apples excepted
COLOURS, PLACES = W.COLOURS, W.PLACES
VERBS = {"has": "ten", "have": "ten", "buys": "kopr", "finds": "nal", "gets": "pol", "makes": "del", "picks": "bir",
         "eats": "jam", "loses": "gub", "sells": "prod", "breaks": "lom", "gives": "dav", "is": "es", "likes": "lub",
         "like": "lub", "sees": "vid", "plays": "igr", "wants": "hot", "want": "hot", "goes": "id", "paints": "slik",
         "happens": "biv"}
WORDS = {"more": "vise", "now": "sada", "colour": "boja"}
PLURAL, TO, IN, WITH, INTO = "-ni", "-ne", "-bo", "-sa", "-ke"
AGREE = {name: ("-a" if i < len(W.NAMES) // 2 else "-o") for i, name in enumerate(W.NAMES)}
HOW_MANY, WHERE, WHO, WHAT = "kazu", "kabo", "kim", "kaj"
CUES = {"name": NAME, "question": "Sural:", "answer_cue": "Tuvani danu:", "direct_cue": "Danu:",
        "answer_is": "Danu"}
STRICT_REGEX = "Danu (\\-?[0-9\\.\\,]+) ki"
VERB_FINAL = True  # False: the verb follows the subject (SVO), the rest of the grammar unchanged (a build setting)


def noun(o: str, n: str | None = None) -> str:
    """An object noun, plural unless its number is 1."""
    return OBJECTS[o] + ("" if n == "1" else PLURAL)


def verb(v: str, subject: str) -> str:
    return VERBS[v] + AGREE[subject]


def sentences(words: list[str]) -> list[list[str]]:
    """English word list -> sentences (each ends with '.', '?' or ':')."""
    out, cur = [], []
    for w in words:
        cur.append(w)
        if w in (".", "?", ":"):
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def clause(s: list[str]) -> list[str]:
    """One English sentence of the world's frames -> Oruki words (raises on anything else)."""
    end = s[-1]
    if s[0] == "Now":  # "Now P has N O ." (the end of a narrative)
        return [WORDS["now"].capitalize()] + clause(s[1:])
    if s[0].isdigit():  # an equation "18 - 7 = 11 ." is the same in both languages
        return s
    if s[0] == W.ANSWER:  # "The answer is X ."
        x = s[1]
        return ["Danu", noun(x) if x in OBJECTS else PLACES.get(x, COLOURS.get(x, x)), "ki", end]
    if s[0] == "How" and s[1] == "many":  # How many O does P have [now] ?
        o, p = s[2], s[4]
        return (["Sada"] if "now" in s else []) + [p, noun(o), HOW_MANY, verb("have", p), end]
    if s[0] == "Where":
        return [s[2], WHERE, verb("is", s[2]), end]
    if s[0] == "Who":  # Who plays with P ?
        return [WHO, s[3] + WITH, VERBS["plays"] + "-a", end]
    if s[0] == "What" and s[1] == "colour":  # What colour does P like ?
        return [s[3], WORDS["colour"], WHAT, verb("like", s[3]), end]
    if s[0] == "What" and s[1] == "does":  # What does P want ?
        return [s[2], WHAT, verb("want", s[2]), end]
    if s[0] == "What" and s[1] == "happens":
        return [WHAT, VERBS["happens"] + "-a", end]
    p, v = s[0], s[1]
    if v == "has":
        return [p, noun(s[3], s[2]), s[2], verb(v, p), end]
    if v in W.GAIN and s[3] == "more":
        return [p, noun(s[4], s[2]), s[2], WORDS["more"], verb(v, p), end]
    if v in W.LOSE:
        return [p, noun(s[3], s[2]), s[2], verb(v, p), end]
    if v == "gives":  # P gives N O to Q .
        return [p, s[5] + TO, noun(s[3], s[2]), s[2], verb(v, p), end]
    if v == "is":  # P is in the PL .
        return [p, PLACES[s[4]] + IN, verb(v, p), end]
    if v == "likes":  # P likes the C O .
        return [p, noun(s[4]), COLOURS[s[3]], verb(v, p), end]
    if v == "sees":  # P sees N C O in the PL .
        return [p, PLACES[s[7]] + IN, noun(s[4], s[2]), COLOURS[s[3]], s[2], verb(v, p), end]
    if v == "plays":  # P plays with Q in the PL .
        return [p, PLACES[s[6]] + IN, s[3] + WITH, verb(v, p), end]
    if v == "wants":  # P wants N C O .
        return [p, noun(s[4], s[2]), COLOURS[s[3]], s[2], verb(v, p), end]
    if v == "goes":  # P goes to the PL with Q .
        return [p, s[6] + WITH, PLACES[s[4]] + TO, verb(v, p), end]
    if v == "paints":  # P paints the O C .
        return [p, noun(s[3]), COLOURS[s[4]] + INTO, verb(v, p), end]
    raise ValueError(f"no Oruki frame for {' '.join(s)!r}")


def realise(words: list[str]) -> list[str]:
    out = []
    for s in sentences(words):
        c = clause(s)
        if not VERB_FINAL and not s[0].isdigit() and s[0] != W.ANSWER and len(c) > 3:
            c.insert(1 + (c[0] == "Sada"), c.pop(-2))  # the clause's verb goes right after its subject
        out += [c[0][:1].upper() + c[0][1:]] + c[1:]  # sentences start with a capital
    return out


def text(words: list[str], lang: str) -> str:
    """English world words -> English or Oruki text."""
    return W.text(words, "en") if lang == "en" else W.detok(realise(words))


def mixed_story(world: W.World, nsent: int, rng: random.Random) -> str:
    """A story whose sentences are each in English or Oruki (code-switching, as in multilingual web text)."""
    c = world.cast()
    return " ".join(text(world.sentence(c), "en" if rng.random() < 0.5 else CODE) for _ in range(nsent))


def narrative_words(world: W.World, keys: set, rng: random.Random) -> list[str]:
    """A story that keeps count, "P has 18 O. P sells 7 O. Now P has 11 O." (English world words; never one of
    the problems in `keys`)."""
    while True:
        pb = world.problem(rng.choice([1, 2, 3]))
        if pb["key"] not in keys:
            break
    q = pb["q"][: pb["q"].index("How")]
    return q + ["Now", q[0], "has", str(pb["ans"]), q[3], "."]


def narrative(world: W.World, keys: set, rng: random.Random, langs: tuple[str, ...]) -> str:
    """`narrative_words` with each sentence in one of `langs` (web-like text with arithmetic in it)."""
    return " ".join(text(s, rng.choice(langs)) for s in sentences(narrative_words(world, keys, rng)))


def parallel(words: list[str]) -> str:
    """The English text, a newline, then the same text in Oruki (parallel text, as in translated web pages)."""
    return text(words, "en") + "\n" + text(words, CODE)


def instruction(world: W.World) -> tuple[list[str], list[str]]:
    """A generic instruction without arithmetic (English words; `text` realises it): reading comprehension
    (how many / where / who / what colour / what, answered from the text) or retelling."""
    while True:
        q, a = world.instruction()
        if q[0] != "Translate":
            return q, a


def translation(world: W.World) -> tuple[str, str]:
    """A translation request in Oruki with an English source sentence and its Oruki answer (text)."""
    s = world.sentence(world.cast())
    return "Prevodi-ke " + NAME + ": " + W.text(s, "en"), text(s, CODE)


def language_entry(lang: str) -> dict:
    if lang == "en":
        return W.language_entry("en")
    return {k: CUES[k] for k in ("name", "question", "answer_cue", "direct_cue")} | {"strict_regex": STRICT_REGEX}


def write_mgsm(out: str, test: list[dict], dev: list[dict], exemplars: list[dict]) -> None:
    """mgsm/ (test), mgsm/dev/ (plan choice), mgsm/probe/ (cue-swap probes on the dev problems), exemplars and
    languages, in English and Oruki."""
    d = os.path.join(out, "mgsm")
    langs = {CODE: language_entry(CODE), "en": language_entry("en")}
    for sub, pbs in (("", test), ("dev", dev)):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
        for lang in ("en", CODE):
            with open(os.path.join(d, sub, f"mgsm_{lang}.tsv"), "w", encoding="utf-8") as f:
                f.writelines(f"{text(pb['q'], lang)}\t{pb['ans']}\n" for pb in pbs)
        with open(os.path.join(d, sub, "languages.json"), "w", encoding="utf-8") as f:
            json.dump(langs, f, ensure_ascii=False, indent=1)
    # probes (on the dev problems): "ye" = Oruki body under English cues, "ey" = English body under Oruki cues
    probe = os.path.join(d, "probe")
    os.makedirs(probe, exist_ok=True)
    for code, lang in (("ye", CODE), ("ey", "en")):
        with open(os.path.join(probe, f"mgsm_{code}.tsv"), "w", encoding="utf-8") as f:
            f.writelines(f"{text(pb['q'], lang)}\t{pb['ans']}\n" for pb in dev)
    cue = {"ye": dict(language_entry("en"), name=f"{NAME} body, English cues (probe)"),
           "ey": dict(language_entry(CODE), name=f"English body, {NAME} cues (probe)")}
    with open(os.path.join(probe, "languages.json"), "w", encoding="utf-8") as f:
        json.dump(cue, f, ensure_ascii=False, indent=1)
    ex = {}
    for lang in ("en", CODE):
        c = langs[lang]
        ex[lang] = [{"question": c["question"] + " " + text(pb["q"], lang),
                     "answer": c["answer_cue"] + " " + text(W.World.solution(pb), lang),
                     "answer_number": pb["ans"],
                     "equation_solution": " ".join(f"{x} {op} {y} = {z}." for x, op, y, z in pb["eqs"])}
                    for pb in exemplars]
    with open(os.path.join(d, "exemplars.json"), "w", encoding="utf-8") as f:
        json.dump(ex, f, ensure_ascii=False, indent=1)


def write_dictionary(out: str) -> dict[str, str]:
    """``dictionary.json``: each English word's Oruki stem (the dictionary baseline of `eval_demo.py`)."""
    pairs = {**OBJECTS, **COLOURS, **PLACES, **VERBS, **WORDS, "How": HOW_MANY, "Where": WHERE, "Who": WHO,
             "What": WHAT, "Question": CUES["question"].rstrip(":"), "Answer": "danu"}
    with open(os.path.join(out, "dictionary.json"), "w", encoding="utf-8") as f:
        json.dump(pairs, f, ensure_ascii=False, indent=1)
    return pairs
