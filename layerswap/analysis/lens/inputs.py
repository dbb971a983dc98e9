"""What the lens reads: its settings (`LensConfig`, bounded), the prompts and their English twins, the batch.

The focus prompt is MGSM question `index` of `language` (or free text) in MGSM's 0-shot prompt
format for that language, as `layerswap ask` and the evaluation prompt it. Its English twin is
the same question number in English (MGSM is parallel), or a free-text twin. The batch for CKA
is `batch` consecutive questions from the focus question on (wrapping around), each with its
English twin. All of them run in one right-padded pass per model; mean pooling skips padding
and special tokens (BOS states carry no meaning and would dominate the mean).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from layerswap.evaluation import mgsm
from layerswap.engines.base import TokenizingEngine
from layerswap.core.errors import UserError
from layerswap.analysis.lens.classes import TokenClasses, token_classes

if TYPE_CHECKING:
    import torch

MAX_BATCH = 128
MAX_QUESTION_CHARS = 4000
MAX_ANSWER_TOKENS = 64
MAX_PROMPT_TOKENS = 1024
MAX_PASS_TOKENS = 65536  # prompt tokens in one pass (all rows, padded): bounds activation memory
MAX_TOP = 20


@dataclass
class LensConfig:
    """What to look at: a language, one question (MGSM `index` or free text), a batch for CKA, answer tokens."""

    language: str
    index: int | None = None
    question: str | None = None
    twin: str | None = None  # English twin of a free-text question (for the cosine alignment)
    batch: int = 32
    answer_tokens: int = 0  # also lens each position of each model's own greedy answer (up to this many tokens)
    source: str | os.PathLike | None = None  # MGSM folder (default $LAYERSWAP_MGSM_DIR, else the Hub)
    mode: str = mgsm.TASK.mode
    chat_template: bool = False
    top: int = 5

    def validate(self) -> None:
        """Raise UserError (with the fix) for settings out of range and languages the MGSM set does not hold (file
        names only: before any model loads); the other data-dependent checks come in `prepare`."""
        if (self.index is None) == (self.question is None):
            raise UserError("Give either an MGSM question number (--mgsm-lang XX --index N) or a question's text "
                            "(--question \"...\").")
        if self.language == "en":
            raise UserError("The lens compares a language with English: choose a target language other than en.")
        if self.question is not None and not self.question.strip():
            raise UserError("The question is empty: type a question, or choose an MGSM question number.")
        for what, text in (("question", self.question), ("English twin", self.twin)):
            if text is not None and len(text) > MAX_QUESTION_CHARS:
                raise UserError(f"The {what} has {len(text):,} characters; the lens takes at most "
                                f"{MAX_QUESTION_CHARS:,}. Shorten it.")
        if self.twin is not None and self.question is None:
            raise UserError("An English twin goes with a free-text question; MGSM questions have theirs.")
        if not 1 <= int(self.batch) <= MAX_BATCH:
            raise UserError(f"The batch is {self.batch}; choose 1 to {MAX_BATCH} parallel questions (CKA needs 3 or more).")
        if not 0 <= int(self.answer_tokens) <= MAX_ANSWER_TOKENS:
            raise UserError(f"Answer tokens: {self.answer_tokens}; choose 0 (none) to {MAX_ANSWER_TOKENS}.")
        if not 1 <= int(self.top) <= MAX_TOP:
            raise UserError(f"Top tokens: {self.top}; choose 1 to {MAX_TOP}.")
        mgsm.TASK.check_mode(self.mode)
        mgsm.check_languages([self.language, "en"], self.source)


@dataclass
class Batch:
    """The rows of one pass: token ids (right-padded), mask, pooling weights, and which row is what."""

    texts: list[str]
    ids: "torch.Tensor"  # S x T
    mask: "torch.Tensor"  # S x T, 1 = token
    pool: "torch.Tensor"  # S x T float32: mean over each row's non-special tokens
    last: list[int]  # index of each row's last token
    focus: int = 0
    twin: int | None = None
    cka_target: list[int] = field(default_factory=list)
    cka_english: list[int] = field(default_factory=list)


@dataclass
class Prepared:
    """Everything the models are asked, and the token classes they are scored with."""

    config: LensConfig
    language_name: str
    prompt: str
    twin: str | None
    batch_indices: list[int]
    batch: Batch
    focus_ids: list[int]
    classes: TokenClasses
    stop: list[str]
    encoder: TokenizingEngine


def _source(config: LensConfig):
    return config.source if config.source is not None else mgsm.default_data_dir()


def prepare(config: LensConfig, tokenizer, vocab_size: int) -> Prepared:
    """Prompts, twins, the batch and the token classes for `config` (MGSM data and English are required)."""
    config.validate()
    src = _source(config)
    every_t = mgsm.prompts(config.language, mode=config.mode, source=src)  # the prompts the evaluation sends
    lang = every_t[0].language
    try:
        every_e = mgsm.prompts("en", mode=config.mode, source=src)
    except UserError as e:
        raise UserError(f"The lens compares with English, so it needs MGSM's English questions beside "
                        f"{lang.name}'s: {e}") from None
    if len(every_e) != len(every_t):
        raise UserError(f"{lang.name} has {len(every_t)} MGSM questions and English {len(every_e)}; the lens needs "
                        "parallel sets (question i in both languages is the same problem).")
    n = len(every_t)
    if config.index is not None and not 0 <= config.index < n:
        raise UserError(f"MGSM {config.language} has questions 0..{n - 1}; {config.index} is out of range.")
    enc = TokenizingEngine(tokenizer, use_chat_template=config.chat_template)

    def free(q: str, code: str) -> str:
        return mgsm.prompt_for(code, question=q, mode=config.mode, source=src).prompt

    start = config.index or 0
    idx = [(start + k) % n for k in range(min(config.batch, n))]
    target = [every_t[i].prompt for i in idx]
    english = [every_e[i].prompt for i in idx]
    if config.index is not None:
        prompt, twin = target[0], english[0]
        texts, focus, twin_row = target + english, 0, len(target)
        cka_t, cka_e = list(range(len(idx))), list(range(len(idx), 2 * len(idx)))
    else:
        prompt = free(config.question, config.language)
        twin = free(config.twin, "en") if config.twin else None
        head = [prompt] + ([twin] if twin else [])
        texts, focus, twin_row = head + target + english, 0, (1 if twin else None)
        cka_t = list(range(len(head), len(head) + len(idx)))
        cka_e = [i + len(idx) for i in cka_t]
    batch = encode_batch(texts, enc, tokenizer)
    batch.focus, batch.twin, batch.cka_target, batch.cka_english = focus, twin_row, cka_t, cka_e
    all_t = [p.prompt for p in every_t] + _exemplar_texts(config.language, src)
    all_e = [p.prompt for p in every_e] + _exemplar_texts("en", src)
    classes = token_classes(tokenizer, vocab_size, config.language, lang.name, all_t, all_e, enc.encode)
    return Prepared(config, lang.name, prompt, twin, idx, batch, enc.encode(prompt), classes, lang.stop, enc)


def _exemplar_texts(code: str, src) -> list[str]:
    """The few-shot exemplars' questions and worked answers (the language's answer phrases), when the folder has them."""
    try:
        return [ex.question + "\n" + ex.answer for ex in mgsm.load_exemplars(code, src)]
    except UserError:
        return []


def encode_batch(texts: list[str], enc: TokenizingEngine, tokenizer) -> Batch:
    """Right-padded ids (so every row's positions and attention are those of the row alone) and pooling weights."""
    import torch

    rows = [enc.encode(t) for t in texts]
    for t, r in zip(texts, rows):
        if len(r) > MAX_PROMPT_TOKENS:
            raise UserError(f"A prompt is {len(r):,} tokens long; the lens takes at most {MAX_PROMPT_TOKENS:,} "
                            f"(it starts {t[:60]!r}). Shorten the question.")
        if not r:
            raise UserError(f"The prompt {t[:60]!r} encodes to no tokens.")
    width = max(len(r) for r in rows)
    if width * len(rows) > MAX_PASS_TOKENS:
        raise UserError(f"{len(rows)} prompts of up to {width} tokens make {width * len(rows):,} positions in one pass; "
                        f"at most {MAX_PASS_TOKENS:,}: lower the batch.")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    pool = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
        keep = [j for j, t in enumerate(r) if t not in special] or list(range(len(r)))
        pool[i, keep] = 1.0 / len(keep)
    return Batch(texts, ids, mask, pool, [len(r) - 1 for r in rows])
