"""MGSM: data loading, lm-evaluation-harness prompts, answer extraction and exact-match scoring.

Mirrors lm-evaluation-harness ``mgsm_native_cot_XX`` (and ``mgsm_direct_XX``):

- prompt (0-shot, test doc):  ``QUESTION + " " + question + "\\n" + ANSWER_CUE``
- few-shot: ``exemplar.question + "\\n" + CUE + " " + rationale + "\\n\\n"`` blocks before it,
  sampled with ``random.Random(1234)`` as lm-eval does
- greedy, stop at the native question word, ``</s>``, ``<|im_end|>`` (and EOS), 256 new tokens
- strict-match: the language's "The answer is N" regex, first match; flexible-extract: the last
  number-like span; exact match after lower-casing and deleting punctuation.

Data: ``mgsm_XX.tsv`` files (``question<TAB>answer``) from a local folder (or a shipped one named by
an ``assets:`` reference, e.g. ``assets:demo/mgsm``), or the same files from the Hub dataset
``juletxara/mgsm``. A folder may add languages (e.g. the demo organism's constructed language) with a
``languages.json`` of the same fields as `Language`.
"""

from __future__ import annotations

import json
import os
import random
import re
import string
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from layerswap.core.errors import UserError
from layerswap.models.hub import hub_error, hub_reachable
from layerswap.models.presets import ASSETS_PREFIX, assets_path, portable_ref

HUB_DATASET = "juletxara/mgsm"
MAX_NEW_TOKENS = 256
FEWSHOT_SEED = 1234
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


@dataclass(frozen=True)
class Task:
    """MGSM as one task object, as lm-eval has: its prompt modes, few-shot range, metrics and defaults, said once.
    The CLI's flags, the page's controls, sweep files, search, the lens and the card ask `TASK`; the prompts
    (`prompts`, `prompt_for`) and the scoring (`score`) below follow it."""

    modes: tuple[tuple[str, str], ...] = (("native_cot", "native CoT (mgsm_native_cot)"),
                                          ("direct", "direct (mgsm_direct)"))  # (name, label); lm-eval's families
    mode: str = "native_cot"  # the default: lm-eval's mgsm_native_cot
    max_shots: int = 8  # exemplars.json holds 8 per language (lm-eval's 8-shot setup)
    shots: int = 0  # the default: 0 shots, as lm-eval
    metrics: tuple[tuple[str, str], ...] = (("flexible", "flexible extraction (last number)"),
                                            ("strict", 'strict extraction ("The answer is N")'))  # headline first
    max_new_tokens: int = MAX_NEW_TOKENS

    @property
    def mode_names(self) -> tuple[str, ...]:
        return tuple(m for m, _ in self.modes)

    @property
    def shot_range(self) -> range:
        return range(0, self.max_shots + 1)

    @property
    def metric_names(self) -> tuple[str, ...]:
        return tuple(m for m, _ in self.metrics)

    def check_mode(self, mode: str) -> str:
        if mode not in self.mode_names:
            raise UserError(f"Unknown MGSM mode {mode!r}; use {' or '.join(self.mode_names)}.")
        return mode

    def check_shots(self, shots: int) -> int:
        if not isinstance(shots, int) or isinstance(shots, bool) or shots not in self.shot_range:
            raise UserError(f"shots must be between 0 and {self.max_shots}, not {shots!r}.")
        return shots

    def check_metric(self, metric: str) -> str:
        if metric not in self.metric_names:
            raise UserError(f"Unknown MGSM metric {metric!r}; use {' or '.join(self.metric_names)}.")
        return metric


TASK = Task()


@dataclass(frozen=True)
class Language:
    code: str
    name: str
    question: str  # prefix of test questions, and a stop string
    answer_cue: str  # native "Step-by-Step Answer:"
    direct_cue: str  # "Answer:" cue of mgsm_direct
    strict_regex: str  # native "The answer is (N)"

    @property
    def stop(self) -> list[str]:
        return [self.question, "</s>", "<|im_end|>"]


_N = r"(\-?[0-9\.\,]+)"
LANGUAGES: dict[str, Language] = {
    lang.code: lang
    for lang in [
        Language("bn", "Bengali", "প্রশ্ন:", "ধাপে ধাপে উত্তর:", "Answer:", f"The answer is {_N}"),
        Language("de", "German", "Frage:", "Schritt-für-Schritt-Antwort:", "Antwort:", f"Die Antwort lautet {_N}"),
        Language("en", "English", "Question:", "Step-by-Step Answer:", "Answer:", f"The answer is {_N}"),
        Language("es", "Spanish", "Pregunta:", "Respuesta paso a paso:", "Respuesta:", f"La respuesta es {_N}"),
        Language("fr", "French", "Question :", "Réponse étape par étape :", "Réponse :", f"La réponse est {_N}"),
        Language("ja", "Japanese", "問題：", "ステップごとの答え:", "Answer:", f"答えは{_N}です。"),
        Language("ru", "Russian", "Задача:", "Пошаговоерешение:", "Answer:", f"Ответ — {_N}"),
        Language("sw", "Swahili", "Swali:", "Jibu la Hatua kwa Hatua:", "Answer:", f"Jibu ni {_N}"),
        Language("te", "Telugu", "ప్రశ్న:", "దశలవారీగా సమాధానం:", "Answer:", f"సమాధానం {_N}"),
        Language("th", "Thai", "โจทย์:", "คำตอบทีละขั้นตอน:", "Answer:", f"คำตอบคือ {_N}"),
        Language("zh", "Chinese", "问题：", "逐步解答:", "Answer:", f"答案是 {_N}。"),
    ]
}
PAPER_LANGS = ("sw", "te", "bn", "ja")


@dataclass(frozen=True)
class Item:
    lang: str
    index: int
    question: str
    answer: int


@dataclass(frozen=True)
class Exemplar:
    question: str  # already starts with the native question word
    answer: str  # starts with the native answer cue
    answer_number: int


# ---- data ----------------------------------------------------------------------------------

def default_data_dir() -> Path | None:
    """``$LAYERSWAP_MGSM_DIR`` if set, else None (meaning: the Hub)."""
    d = os.environ.get("LAYERSWAP_MGSM_DIR")
    return Path(d).expanduser() if d else None


def folder(source: str | os.PathLike | None) -> Path | None:
    """The data folder `source` names: a path, or a shipped set by its ``assets:`` reference (None stays None)."""
    if source is None:
        return None
    if str(source).startswith(ASSETS_PREFIX):
        return assets_path(str(source))
    return Path(source).expanduser()


def languages(source: str | os.PathLike | None = None) -> dict[str, Language]:
    """Built-in MGSM languages plus any defined by ``languages.json`` in a local folder."""
    langs = dict(LANGUAGES)
    src = folder(source)
    if src is not None and (src / "languages.json").exists():
        langs.update(_extra_languages(str(src / "languages.json")))
    return langs


@lru_cache(maxsize=8)
def _extra_languages(path: str) -> dict[str, Language]:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        return {code: Language(code=code, **{k: v[k] for k in ("name", "question", "answer_cue", "direct_cue",
                                                              "strict_regex")}) for code, v in raw.items()}
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path} is malformed ({e}); each language needs name, question, answer_cue, "
                        "direct_cue and strict_regex.") from None


def available_languages(source: str | os.PathLike | None = None) -> list[str]:
    """Languages with data: the TSVs present in a folder, or every MGSM language on the Hub."""
    if source is None:
        return list(LANGUAGES)
    return sorted(p.stem.removeprefix("mgsm_") for p in folder(source).glob("mgsm_*.tsv"))


def get_language(code: str, source: str | os.PathLike | None = None) -> Language:
    langs = languages(source)
    if code not in langs:
        raise UserError(f"Unknown MGSM language {code!r}; choose one of: {', '.join(sorted(langs))}.")
    return langs[code]


def check_languages(codes, source: str | os.PathLike | None = None) -> None:
    """Refuse, with what there is, a language the set does not hold: unknown, or with no questions in a local
    folder (`source`, else ``$LAYERSWAP_MGSM_DIR``; the Hub holds every built-in language). Cheap: file names only,
    so commands say it before any model loads."""
    src = source if source is not None else default_data_dir()
    langs = languages(src)
    have = available_languages(src) if src is not None else list(LANGUAGES)
    bad = [c for c in codes if c not in langs or c not in have]
    if bad:
        where = f"The MGSM set {portable_ref(src)}" if src is not None else "The MGSM set"
        offer = [c for c in have if c in langs]
        name = lambda c: f"{c} ({langs[c].name})" if c in langs else repr(c)  # noqa: E731
        raise UserError(f"{where} has no language {', '.join(map(name, bad))}; it has: "
                        f"{', '.join(map(name, offer)) or 'none'}.")


def parse_tsv(text: str, lang: str, origin: str) -> list[Item]:
    """``question<TAB>answer`` per line; answers may hold thousands separators (``2,125``)."""
    items = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        if "\t" not in line:
            raise UserError(f"{origin}, line {i + 1}: expected 'question<TAB>answer', found no tab.")
        q, a = line.rsplit("\t", 1)
        try:
            ans = float(a.strip().replace(",", ""))
        except ValueError:
            raise UserError(f"{origin}, line {i + 1}: answer {a.strip()!r} is not a number.") from None
        if ans != int(ans):
            raise UserError(f"{origin}, line {i + 1}: answer {a.strip()!r} is not a whole number.")
        items.append(Item(lang, len(items), q.strip(), int(ans)))
    if not items:
        raise UserError(f"{origin} holds no questions.")
    return items


@lru_cache(maxsize=32)
def _load(lang: str, source: str | None) -> tuple[Item, ...]:
    if source is not None:
        path = Path(source) / f"mgsm_{lang}.tsv"
        if not path.exists():
            have = available_languages(source)
            raise UserError(f"{path} not found; this folder has: {', '.join(have) or 'no mgsm_XX.tsv files'}.")
        return tuple(parse_tsv(path.read_text(encoding="utf-8"), lang, str(path)))
    return tuple(parse_tsv(_download_tsv(lang), lang, f"{HUB_DATASET}:mgsm_{lang}.tsv"))


def load(lang: str, source: str | os.PathLike | None = None) -> list[Item]:
    """All questions of one language from `source` (a folder), ``$LAYERSWAP_MGSM_DIR``, or the Hub."""
    src = folder(source if source is not None else default_data_dir())
    get_language(lang, src)
    return list(_load(lang, None if src is None else str(src)))


def _download_tsv(lang: str) -> str:
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(HUB_DATASET, f"mgsm_{lang}.tsv", repo_type="dataset")
    if isinstance(cached, str):
        return Path(cached).read_text(encoding="utf-8")
    try:
        if not hub_reachable():
            raise ConnectionError("the Hugging Face Hub is not reachable from this machine")
        path = hf_hub_download(HUB_DATASET, f"mgsm_{lang}.tsv", repo_type="dataset")
        return Path(path).read_text(encoding="utf-8")
    except Exception as e:
        raise UserError(
            f"Could not get mgsm_{lang}.tsv from the Hub dataset {HUB_DATASET} ({hub_error(e)}). "
            "When offline, point --mgsm-dir (or LAYERSWAP_MGSM_DIR) at a folder of mgsm_XX.tsv files."
        ) from None


def load_exemplars(lang: str, source: str | os.PathLike | None = None) -> list[Exemplar]:
    """The 8 few-shot exemplars of `lang` from ``exemplars.json`` in the data folder."""
    src = folder(source if source is not None else default_data_dir())
    if src is None:
        raise UserError("Few-shot prompts need exemplars.json: pass --mgsm-dir with an MGSM folder that has it.")
    path = src / "exemplars.json"
    if not path.exists():
        raise UserError(f"{path} not found: few-shot prompts need it (use 0 shots, or add the file).")
    data = json.loads(path.read_text(encoding="utf-8"))
    if lang not in data:
        raise UserError(f"{path} has no exemplars for {lang!r} (it has {', '.join(sorted(data))}).")
    return [Exemplar(e["question"], e["answer"], int(e["answer_number"])) for e in data[lang]]


# ---- prompts -------------------------------------------------------------------------------

def build_prompt(question: str, lang: Language, *, mode: str = TASK.mode,
                 exemplars: list[Exemplar] | None = None, rng: random.Random | None = None,
                 shots: int = TASK.shots) -> str:
    """The lm-eval ``mgsm_native_cot`` (or ``mgsm_direct``) prompt for one test question."""
    TASK.check_mode(mode)
    cue = lang.answer_cue if mode == "native_cot" else lang.direct_cue
    parts = []
    if shots:
        if not exemplars or shots > len(exemplars):
            raise UserError(f"{shots}-shot prompts need {shots} exemplars for {lang.code}; "
                            f"found {len(exemplars or [])}.")
        for ex in (rng or random.Random(FEWSHOT_SEED)).sample(exemplars, shots):
            if mode == "native_cot":
                # lm-eval's own slice: answer[len(CUE)+1:] (it drops one extra character for zh/ja)
                parts.append(ex.question + "\n" + cue + " " + ex.answer[len(cue) + 1:] + "\n\n")
            else:
                parts.append(ex.question + "\n" + cue + str(ex.answer_number) + "\n\n")
    parts.append(lang.question + " " + question + "\n" + cue)
    return "".join(parts)


@dataclass(frozen=True)
class Prompt:
    """A prompt to generate from: its text, its language (stop strings, strict answer pattern), the mode it is
    scored in, and, for a question of the set, its index, text and gold answer (None for free text)."""

    prompt: str
    language: Language
    gold: int | None  # None for a free-text question
    index: int | None  # the question's index in its set, None for free text
    question: str = ""
    mode: str = TASK.mode

    def score(self, output: str) -> "Scored":
        return score(output, self.gold, self.language, self.mode)


def prompts(lang_code: str, *, limit: int | None = None, shots: int = TASK.shots, mode: str = TASK.mode,
            source: str | os.PathLike | None = None) -> list[Prompt]:
    """The set's test prompts of `lang_code` in file order (the first `limit`), as lm-eval builds them: one
    exemplar sampler (``random.Random(FEWSHOT_SEED)``) shared across the set's questions. `source`: a
    folder, else ``$LAYERSWAP_MGSM_DIR``, else the Hub."""
    src = source if source is not None else default_data_dir()
    items = load(lang_code, src)
    lang = get_language(lang_code, src)
    exemplars = load_exemplars(lang_code, src) if shots else None
    rng = random.Random(FEWSHOT_SEED)
    return [Prompt(build_prompt(it.question, lang, mode=mode, exemplars=exemplars, rng=rng, shots=shots), lang,
                   it.answer, it.index, it.question, mode) for it in (items[:limit] if limit else items)]


def prompt_for(lang_code: str, *, question: str | None = None, index: int | None = None,
               source: str | os.PathLike | None = None, shots: int = TASK.shots, mode: str = TASK.mode) -> Prompt:
    """The prompt the app, the Workbench and the evaluation send for one question: question `index` of
    `lang_code`'s MGSM set exactly as the evaluation builds it (`prompts`: the few-shot exemplars lm-eval's
    shared sampler draws for that question), with its gold answer; or the free text `question` in that
    language's format (with the exemplars the set's first question gets). An index outside the set, or one
    that is not a whole number, is refused with the set's range."""
    from layerswap.core.errors import whole_number

    src = source if source is not None else default_data_dir()
    if question is not None:
        lang = get_language(lang_code, src)
        exemplars = load_exemplars(lang_code, src) if shots else None
        return Prompt(build_prompt(question.strip(), lang, mode=mode, exemplars=exemplars, shots=shots), lang, None,
                      None, question.strip(), mode)
    index = whole_number(index, f"The MGSM {lang_code} question", 0, len(load(lang_code, src)) - 1)
    return prompts(lang_code, limit=index + 1, shots=shots, mode=mode, source=src)[index]


# ---- scoring -------------------------------------------------------------------------------

def extract_strict(text: str, lang: Language) -> str:
    """First match of the native "The answer is N" regex, or ``[invalid]``."""
    m = re.findall(lang.strict_regex, text)
    if not m:
        return "[invalid]"
    first = m[0]
    if isinstance(first, tuple):
        first = next((g for g in first if g), "")
    return first.strip()


def extract_flexible(text: str) -> str:
    """The last number-like span of the text (lm-eval's ``flexible-extract``), or ``[invalid]``."""
    m = FLEXIBLE_RE.findall(text)
    if not m:
        return "[invalid]"
    last = m[-1]
    return next((g for g in last if g), "").strip()


_PUNCT = str.maketrans("", "", string.punctuation)


def normalize(s: str) -> str:
    """lm-eval exact_match with ignore_case and ignore_punctuation."""
    return s.lower().translate(_PUNCT)


def is_correct(extracted: str, gold: int) -> bool:
    return normalize(extracted) == normalize(str(gold))


@dataclass
class Scored:
    output: str
    strict: str
    flexible: str
    strict_correct: bool
    flexible_correct: bool

    def to_dict(self) -> dict:
        return asdict(self)


def score(output: str, gold: int | None, lang: Language, mode: str = TASK.mode) -> Scored:
    """Strict and flexible extraction, scored by exact match.

    In ``direct`` mode "strict" is lm-eval's ``remove_whitespace`` filter (the whole output, leading
    whitespace removed) instead of the "The answer is N" regex.
    """
    s = output.lstrip() if mode == "direct" else extract_strict(output, lang)
    f = extract_flexible(output)
    ok = gold is not None
    return Scored(output, s, f, ok and is_correct(s, gold), ok and is_correct(f, gold))
