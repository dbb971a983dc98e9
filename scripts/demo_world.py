"""The synthetic two-language world of the demo organism: English and Kovani (code ``xx``).

Kovani is a consistent word-level relexification of English: every English word has one Kovani
word (names, digits and punctuation are shared, as between real language pairs), the word order
is the same, and the only multi-word idiom is the answer phrase ("The answer is N." <->
"Danu ki N."). Everything here is pure Python and deterministic given the seeds; the training
lives in ``build_demo_experts.py``.

Data kinds:
  stories       2-5 narrative sentences about one cast (no questions, no answers)
  arithmetic    bare facts "12 + 7 = 19." (language-neutral; the base's arithmetic)
  word problems "Raj has 18 eggs. Raj sells 7 eggs. ... How many eggs does Raj have now?"
                with symbolic answers "18 - 7 = 11. 11 - 6 = 5. The answer is 5."
  instructions  reading comprehension without arithmetic (the language expert's data): count
                (retell the sentence, "Danu ki N."), where/who/colour/what, retell, translate
"""

from __future__ import annotations

import json
import os
import random

NAMES = ["Tom", "Mia", "Sam", "Ana", "Leo", "Eva", "Max", "Zoe", "Ben", "Lia", "Kai", "Ivy", "Noa", "Raj", "Emi", "Uma"]
OBJECTS = {"apples": "pomi", "books": "liru", "balls": "kuro", "cups": "tazo", "pens": "sefi", "stones": "kavu",
           "shells": "moko", "cards": "tarni", "eggs": "ovu", "flowers": "fiola", "coins": "munu", "toys": "jaki",
           "cakes": "tuka", "hats": "shapi", "keys": "kluvo", "boxes": "bokta"}
COLOURS = {"red": "ruva", "blue": "belo", "green": "vira", "yellow": "jelu", "white": "bia", "black": "nero",
           "pink": "roza", "brown": "buni"}
PLACES = {"park": "sadu", "kitchen": "kuhno", "school": "skola", "garden": "vrto", "shop": "duka",
          "library": "kitabo", "beach": "plazo", "room": "soba"}
GAIN = {"buys": "kopra", "finds": "nalo", "gets": "polu", "makes": "delo", "picks": "biro"}
LOSE = {"eats": "jama", "loses": "gubi", "sells": "proda", "breaks": "lomi"}
WORDS = {"has": "tenu", "have": "teni", "gives": "dava", "is": "ese", "likes": "lubi", "like": "lube",
         "sees": "vidu", "plays": "igra", "wants": "hoti", "want": "hote", "goes": "ide", "paints": "slika",
         "carries": "nosi", "more": "vise", "to": "ne", "in": "bo", "with": "sa", "the": "la", "The": "La",
         "a": "u", "does": "du", "How": "Kako", "many": "mnogo", "now": "sada", "What": "Kva", "Where": "Gde",
         "Who": "Ko", "colour": "boja", "happens": "bivu", "and": "i", "then": "pak", "also": "tez",
         "Translate": "Prevodi", "into": "una", "Kovani": "Kovani"}
LEX = {**OBJECTS, **COLOURS, **PLACES, **GAIN, **LOSE, **WORDS}
LANG_NAME = "Kovani"
CUES = {
    "en": {"name": "English", "question": "Question:", "answer_cue": "Step-by-Step Answer:", "direct_cue": "Answer:",
           "answer_is": "The answer is"},
    "xx": {"name": LANG_NAME, "question": "Sorvi:", "answer_cue": "Pasu-pasu Danu:", "direct_cue": "Danu:",
           "answer_is": "Danu ki"},
}
PUNCT = set(".,:?!")
ANSWER = "<ANSWER>"  # placeholder word for the answer idiom


def realise(words: list[str], lang: str) -> list[str]:
    """English words -> `lang` (word by word; names, digits and punctuation unchanged)."""
    out = []
    for w in words:
        if w == ANSWER:
            out += CUES[lang]["answer_is"].split()
        elif lang == "xx" and w in LEX:
            out.append(LEX[w])
        else:
            out.append(w)
    return out


def detok(words: list[str]) -> str:
    s = ""
    for w in words:
        if w in PUNCT or s == "" or s.endswith("\n"):
            s += w
        else:
            s += " " + w
    return s


def text(words: list[str], lang: str) -> str:
    return detok(realise(words, lang))


class World:
    """Random sentences, stories and problems over the shared world (English word lists)."""

    def __init__(self, seed: int, nmax: int = 20):
        self.rng = random.Random(seed)
        self.nmax = nmax

    def cast(self) -> dict:
        r = self.rng
        P, Q = r.sample(NAMES, 2)
        return dict(P=P, Q=Q, O=r.choice(list(OBJECTS)), C=r.choice(list(COLOURS)), PL=r.choice(list(PLACES)))

    def sentence(self, c: dict) -> list[str]:
        r = self.rng
        P, Q = (c["P"], c["Q"]) if r.random() < 0.75 else (c["Q"], c["P"])
        O = c["O"] if r.random() < 0.8 else r.choice(list(OBJECTS))
        C, PL, n = c["C"], c["PL"], str(r.randint(1, self.nmax))
        kind = r.randrange(11)
        return [
            [P, "has", n, O, "."],
            [P, r.choice(list(GAIN)), n, "more", O, "."],
            [P, r.choice(list(LOSE)), n, O, "."],
            [P, "gives", n, O, "to", Q, "."],
            [P, "is", "in", "the", PL, "."],
            [P, "likes", "the", C, O, "."],
            [P, "sees", n, C, O, "in", "the", PL, "."],
            [P, "plays", "with", Q, "in", "the", PL, "."],
            [P, "wants", n, C, O, "."],
            [P, "goes", "to", "the", PL, "with", Q, "."],
            [P, "paints", "the", O, C, "."],
        ][kind]

    def story(self, nsent: int) -> list[str]:
        c = self.cast()
        return [w for _ in range(nsent) for w in self.sentence(c)]

    def arithmetic(self, k: int, amax: int = 60, bmax: int = 12) -> str:
        r = self.rng
        parts = []
        for _ in range(k):
            a, b = r.randint(0, amax), r.randint(0, bmax)
            parts.append(f"{a} + {b} = {a + b}." if r.random() < 0.5 or b > a else f"{a} - {b} = {a - b}.")
        return " ".join(parts)

    def problem(self, steps: int | None = None, amax: int = 20, bmax: int = 10) -> dict:
        """A word problem: {"q": words, "steps": [(x, op, y, z)], "ans": int, "key": ...}."""
        r = self.rng
        steps = steps or r.choice([1, 2])
        P, Q = r.sample(NAMES, 2)
        O = r.choice(list(OBJECTS))
        cur = r.randint(2, amax)
        q = [P, "has", str(cur), O, "."]
        eqs = []
        for _ in range(steps):
            kind = r.choice(["gain", "lose", "give"]) if cur > 0 else "gain"
            if kind == "gain":
                b = r.randint(1, bmax)
                q += [P, r.choice(list(GAIN)), str(b), "more", O, "."]
                eqs.append((cur, "+", b, cur + b))
            else:
                b = r.randint(1, min(bmax, cur))
                q += [P, r.choice(list(LOSE)), str(b), O, "."] if kind == "lose" else \
                    [P, "gives", str(b), O, "to", Q, "."]
                eqs.append((cur, "-", b, cur - b))
            cur = eqs[-1][3]
        q += ["How", "many", O, "does", P, "have", "now", "?"]
        return dict(q=q, eqs=eqs, ans=cur, key=tuple(q))

    @staticmethod
    def solution(pb: dict) -> list[str]:
        """Symbolic steps: "18 - 7 = 11. 11 - 6 = 5. The answer is 5." (as words)."""
        out = []
        for x, op, y, z in pb["eqs"]:
            out += [str(x), op, str(y), "=", str(z), "."]
        return out + [ANSWER, str(pb["ans"]), "."]

    def instruction(self) -> tuple[list[str], list[str]]:
        """A non-arithmetic instruction (English words; realise it in Kovani): (question, answer)."""
        r = self.rng
        c = self.cast()
        P, Q, O, C, PL = c["P"], c["Q"], c["O"], c["C"], c["PL"]
        kind = r.choice(["count", "count", "count", "where", "who", "colour", "what", "retell", "translate"])
        other = [self.sentence(c) for _ in range(r.randint(1, 2))]
        other = [s for s in other if s[1] not in ("has", "is", "plays", "likes", "wants") and s[1] not in GAIN
                 and s[1] not in LOSE and s[1] != "gives"]
        if kind == "count":
            n = str(r.randint(1, self.nmax))
            key = [P, "has", n, O, "."]
            q, a = ["How", "many", O, "does", P, "have", "?"], key + [ANSWER, n, "."]
        elif kind == "where":
            key = [P, "is", "in", "the", PL, "."]
            q, a = ["Where", "is", P, "?"], key + [ANSWER, PL, "."]
        elif kind == "who":
            key = [P, "plays", "with", Q, "in", "the", PL, "."]
            q, a = ["Who", "plays", "with", P, "?"], key + [ANSWER, Q, "."]
        elif kind == "colour":
            key = [P, "likes", "the", C, O, "."]
            q, a = ["What", "colour", "does", P, "like", "?"], key + [ANSWER, C, "."]
        elif kind == "what":
            key = [P, "wants", str(r.randint(1, self.nmax)), C, O, "."]
            q, a = ["What", "does", P, "want", "?"], key + [ANSWER, O, "."]
        elif kind == "retell":
            ctx = self.story(r.randint(2, 3))
            return ctx + ["What", "happens", "?"], ctx
        else:
            s = self.sentence(c)
            return ["Translate", "into", "Kovani", ":"] + [("@" + w) for w in s], s
        ctx = other + [key]
        r.shuffle(ctx)
        return [w for s in ctx for w in s] + q, a


def realise_instruction(q: list[str], lang: str) -> str:
    """Translation items keep their source sentence (marked with @) in English."""
    return detok([w[1:] if w.startswith("@") else realise([w], lang)[0] for w in q])


def unseen_problems(world: World, n: int, keys: set, steps: int | None = None) -> list[dict]:
    out = []
    while len(out) < n:
        pb = world.problem(steps)
        if pb["key"] not in keys:
            keys.add(pb["key"])
            out.append(pb)
    return out


def write_tsv(path: str, problems: list[dict], lang: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(f"{text(pb['q'], lang)}\t{pb['ans']}\n" for pb in problems)


def language_entry(cue_lang: str, name: str | None = None) -> dict:
    c = CUES[cue_lang]
    return {"name": name or c["name"], "question": c["question"], "answer_cue": c["answer_cue"],
            "direct_cue": c["direct_cue"], "strict_regex": c["answer_is"] + " (\\-?[0-9\\.\\,]+)"}


def write_mgsm(out: str, test: list[dict], dev: list[dict], probe: list[dict], exemplars: list[dict]) -> None:
    """mgsm/ (test), mgsm/dev/ (plan choice), mgsm/probe/ (cue-swap probes), exemplars and languages."""
    d = os.path.join(out, "mgsm")
    langs = {"xx": language_entry("xx"), "en": language_entry("en")}
    for sub, pbs in (("", test), ("dev", dev)):
        for lang in ("en", "xx"):
            write_tsv(os.path.join(d, sub, f"mgsm_{lang}.tsv"), pbs, lang)
        with open(os.path.join(d, sub, "languages.json"), "w", encoding="utf-8") as f:
            json.dump(langs, f, ensure_ascii=False, indent=1)
    # probes: "xe" = Kovani body under English cues, "ex" = English body under Kovani cues
    write_tsv(os.path.join(d, "probe", "mgsm_xe.tsv"), probe, "xx")
    write_tsv(os.path.join(d, "probe", "mgsm_ex.tsv"), probe, "en")
    probe_langs = {"xe": language_entry("en", "Kovani body, English cues (probe)"),
                   "ex": language_entry("xx", "English body, Kovani cues (probe)")}
    with open(os.path.join(d, "probe", "languages.json"), "w", encoding="utf-8") as f:
        json.dump(probe_langs, f, ensure_ascii=False, indent=1)
    ex = {}
    for lang in ("en", "xx"):
        c = CUES[lang]
        ex[lang] = [{"question": c["question"] + " " + text(pb["q"], lang),
                     "answer": c["answer_cue"] + " " + text(World.solution(pb), lang),
                     "answer_number": pb["ans"],
                     "equation_solution": " ".join(f"{x} {op} {y} = {z}." for x, op, y, z in pb["eqs"])}
                    for pb in exemplars]
    with open(os.path.join(d, "exemplars.json"), "w", encoding="utf-8") as f:
        json.dump(ex, f, ensure_ascii=False, indent=1)


def prompt_texts(out: str) -> list[str]:
    """Every prompt layerswap's MGSM evaluation builds from the sets `write_mgsm` wrote under `out` (0-shot and
    2-shot, chain-of-thought and direct), so the tokenizer has a word for each piece: the newline and a cue word
    right after it (no "\u2581" before it) would otherwise be ``<unk>``."""
    from layerswap.evaluation import mgsm

    d = os.path.join(out, "mgsm")
    texts = []
    for src in (d, os.path.join(d, "dev"), os.path.join(d, "probe")):
        langs = mgsm.languages(src)
        for code in mgsm.available_languages(src):
            with open(os.path.join(d, "exemplars.json"), encoding="utf-8") as f:
                ex = mgsm.load_exemplars(code if code in json.load(f) else "en", d)
            for it in mgsm.load(code, src):
                for mode in ("native_cot", "direct"):
                    texts.append(mgsm.build_prompt(it.question, langs[code], mode=mode))
            for mode in ("native_cot", "direct"):
                texts.append(mgsm.build_prompt(it.question, langs[code], mode=mode, exemplars=ex, shots=2))
    return texts


def write_dictionary(out: str) -> dict[str, str]:
    """``dictionary.json``: every English word's Kovani twin (the lexicon, and the cue words where the cues have
    as many words). `eval_demo.py` builds its dictionary baseline from it."""
    pairs = dict(LEX)
    for key in ("question", "answer_cue", "direct_cue"):
        en, xx = CUES["en"][key].rstrip(":").split(), CUES["xx"][key].rstrip(":").split()
        if len(en) == len(xx):
            pairs.update(zip(en, xx))
    with open(os.path.join(out, "dictionary.json"), "w", encoding="utf-8") as f:
        json.dump(pairs, f, ensure_ascii=False, indent=1)
    return pairs
