"""Token classes for the lens: which vocabulary entries count as target language, English or digits.

The rule (`TokenClasses.rule` says it in words, for the page and the report):

- **digits**: the token's text, spaces stripped, is decimal digits (any script), optionally with
  ``,`` or ``.`` between groups (``12``, ``2,125``, ``৩``).
- For a language written mostly outside the Latin script (more than half of the letters of its
  MGSM prompts; Bengali, Telugu, Japanese, Chinese, Thai, Russian...): **target** = tokens whose
  letters all belong to the scripts that make up at least 10 % of those letters (Unicode
  character names: ``BENGALI``, ``CJK``/``HIRAGANA``/``KATAKANA``...); **English** = tokens whose
  letters are all Latin.
- For a Latin-script language (Swahili, the demo organism's Kovani): **target** = tokens that
  occur in the language's tokenized MGSM text (every question as prompted, plus the few-shot
  exemplars' questions and worked answers when the folder has ``exemplars.json``) and not in the
  English MGSM text; **English** = tokens that occur in the English text and not in the language's.
- Classes are disjoint: digits first, then target, then English; special tokens and everything
  else are "other".
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from layerswap.core.errors import UserError

CLASSES = ("target", "english", "digits", "other")
_DIGITS = re.compile(r"\d+(?:[.,]\d+)*")
_SCRIPT_WORDS = ("LATIN", "CJK", "HIRAGANA", "KATAKANA", "HANGUL")
MIN_SCRIPT_SHARE = 0.10


def script(ch: str) -> str:
    """A letter's script, from its Unicode name (``LATIN``, ``CJK``, ``BENGALI``, ``CYRILLIC``...)."""
    name = unicodedata.name(ch, "")
    for word in _SCRIPT_WORDS:
        if word in name:
            return word
    return name.split(" ")[0] if name else "UNKNOWN"


def letter_scripts(text: str) -> list[str]:
    return [script(c) for c in text if c.isalpha()]


def language_scripts(texts: Sequence[str]) -> tuple[bool, tuple[str, ...]]:
    """(is Latin-script, the scripts that make up >= 10 % of the letters when it is not)."""
    counts = Counter(s for t in texts for s in letter_scripts(t))
    total = sum(counts.values())
    if not total:
        raise UserError("The language's MGSM questions hold no letters; the lens cannot tell its tokens apart.")
    if counts["LATIN"] / total > 0.5:
        return True, ("LATIN",)
    return False, tuple(sorted(s for s, n in counts.items() if s != "LATIN" and n / total >= MIN_SCRIPT_SHARE))


@dataclass
class TokenClasses:
    """One class per vocabulary id (an index into `CLASSES`), and the rule that assigned them."""

    codes: np.ndarray  # int8 per vocabulary id: 0 target, 1 english, 2 digits, 3 other
    rule: str
    language: str
    texts: list[str]  # every id's text, for display

    def of(self, token_id: int) -> str:
        return CLASSES[int(self.codes[token_id])] if 0 <= token_id < len(self.codes) else "other"

    def counts(self) -> dict[str, int]:
        return {c: int((self.codes == i).sum()) for i, c in enumerate(CLASSES)}

    def summary(self) -> str:
        """The rule with how many vocabulary entries each class got."""
        n = self.counts()
        return f"{self.rule} Here: {n['target']:,} target, {n['english']:,} English, {n['digits']:,} digit tokens."


def token_texts(tokenizer, vocab_size: int) -> list[str]:
    """The text of every id the model can predict (ids the tokenizer lacks read as empty)."""
    n = min(len(tokenizer), vocab_size)
    texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    return list(texts) + [""] * (vocab_size - n)


def is_digits(text: str) -> bool:
    return bool(_DIGITS.fullmatch(text.strip()))


def token_classes(tokenizer, vocab_size: int, language: str, language_name: str, target_prompts: Sequence[str],
                  english_prompts: Sequence[str], encode) -> TokenClasses:
    """Classes of the `vocab_size` ids the model predicts, by the module's rule.

    `target_prompts` / `english_prompts`: the MGSM text of the language and of English (every
    question in the lens's prompt format, and the exemplars); `encode(text) -> ids` tokenizes as the lens does.
    """
    texts = token_texts(tokenizer, vocab_size)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    latin, scripts = language_scripts(target_prompts)
    codes = np.full(vocab_size, CLASSES.index("other"), dtype=np.int8)
    digit = np.array([i not in special and is_digits(t) for i, t in enumerate(texts)])
    if latin:
        in_target = {i for p in target_prompts for i in encode(p)}
        in_english = {i for p in english_prompts for i in encode(p)}
        target = np.zeros(vocab_size, dtype=bool)
        english = np.zeros(vocab_size, dtype=bool)
        target[[i for i in in_target - in_english if i < vocab_size]] = True
        english[[i for i in in_english - in_target if i < vocab_size]] = True
        rule = (f"{language_name} is written in the Latin script, so its tokens are those that occur in its tokenized "
                f"MGSM text ({len(target_prompts)} prompts and worked exemplars) and not in the English MGSM text, and "
                "English tokens those that occur in the English text and not in its")
    else:
        sets = [set(letter_scripts(t)) for t in texts]
        target = np.array([bool(s) and s <= set(scripts) for s in sets])
        english = np.array([bool(s) and s == {"LATIN"} for s in sets])
        rule = (f"{language_name} is written mostly in the {'/'.join(scripts)} script(s) (letters of its MGSM prompts), "
                f"so its tokens are those whose letters are all {'/'.join(scripts)}, and English tokens those whose "
                "letters are all Latin")
    target &= ~digit
    english &= ~digit
    for i in special:
        if 0 <= i < vocab_size:
            target[i] = english[i] = digit[i] = False
    codes[target] = CLASSES.index("target")
    codes[english] = CLASSES.index("english")
    codes[digit] = CLASSES.index("digits")
    rule += ("; digits are tokens that are decimal digits (any script, with , or . between groups). Classes are "
             "disjoint (digits first); special tokens and the rest are other.")
    return TokenClasses(codes, rule, language, texts)
