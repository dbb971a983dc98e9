"""What every engine shares: the `Engine` protocol, batching with a per-batch callback, prompts and stops.

An engine answers ``generate(prompts, max_new_tokens, stop, on_batch) -> texts``: one greedy answer
per prompt, in the prompts' order, cut before the first stop string. The engine alone decides how
prompts are batched; after each finished batch it calls ``on_batch(indices, outputs)`` with the
positions (in `prompts`) it just answered and their answers. Whatever ``on_batch`` raises stops the
generation and reaches the caller, which keeps the answers it was already given (that is how an
evaluation is cancelled between batches).

`TokenizingEngine` is the part of the two built-in engines that runs in this process: the same
tokenizer, chat template choice, special tokens, decoding and stop cut, so that the transformers
and vLLM engines answer string for string alike.
"""

from __future__ import annotations

import os
from typing import Callable, Protocol, Sequence, runtime_checkable

from layerswap.models.tokenizer_files import check_tokenizer_folder
from layerswap.core.errors import UserError
from layerswap.engines.chat import render_chat

# on_batch(indices into the prompts, their answers): called after each finished batch
OnBatch = Callable[[list[int], list[str]], None]


@runtime_checkable
class Engine(Protocol):
    """What `layerswap.evaluation.run` and the workbench need of an engine (third-party engines included).

    An engine that does not batch calls ``on_batch(list(range(len(prompts))), outputs)`` once.
    """

    name: str  # which backend answered, shown next to answers

    def generate(self, prompts: list[str], max_new_tokens: int = 256, stop: list[str] | None = None,
                 on_batch: OnBatch | None = None) -> list[str]:
        ...


def generate_in_batches(order: Sequence[int], size: int, run: Callable[[list[int]], list[str]],
                        on_batch: OnBatch | None = None) -> list[str]:
    """Answer the prompts ``order`` lists (every prompt index once, in the order to batch them), `size` at a time.

    ``run(indices)`` answers one batch; the result is in index order, whatever order batched them.
    """
    outputs = [""] * len(order)
    size = max(1, int(size))
    for start in range(0, len(order), size):
        idx = list(order[start:start + size])
        outs = run(idx)
        for i, out in zip(idx, outs):
            outputs[i] = out
        if on_batch is not None:
            on_batch(idx, outs)
    return outputs


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop string (all of it when none occurs)."""
    cut = len(text)
    for s in stop:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def load_tokenizer(path: str | os.PathLike):
    """The model folder's tokenizer, left-padded, with EOS as padding when it has no pad token; its files'
    sizes checked against the config's vocabulary before they are parsed, and its tokens after."""
    from transformers import AutoTokenizer

    vocab = check_tokenizer_folder(path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # a tokenizer file its library cannot read (malformed, too deep): said in one line
        why = (str(e).splitlines() or [""])[0][:160]
        raise UserError(f"{path}: its tokenizer cannot be loaded ({type(e).__name__}: {why}); re-download it "
                        "or use the base's tokenizer.") from None
    if vocab is not None and len(tok) > vocab:
        raise UserError(f"{path}: its tokenizer has {len(tok):,} tokens, more than the model's {vocab:,} "
                        "(config.json's vocab_size); re-download it or use the base's tokenizer.")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def chat_template_choice(tokenizer, use_chat_template: bool | None) -> bool:
    """Use the chat template only when asked (error if there is none); by default (None, False) never: a
    model's template is code it brings, rendered only on request and then with bounds (`chat.render_chat`)."""
    if use_chat_template and not getattr(tokenizer, "chat_template", None):
        raise UserError("This model's tokenizer has no chat template, so it cannot be prompted as a chat; "
                        "run without --chat-template (plain MGSM prompts, as lm-eval does by default).")
    if use_chat_template:
        render_chat(tokenizer, "2+2?")  # a template that cannot render is refused before any weight loads
    return bool(use_chat_template)


class TokenizingEngine:
    """Prompts to token ids and token ids to answers, the same way for every built-in engine."""

    def __init__(self, tokenizer, use_chat_template: bool | None = None):
        self.tokenizer = tokenizer
        self.use_chat_template = chat_template_choice(tokenizer, use_chat_template)
        self.tokens_generated = 0  # output tokens so far (throughput accounting)

    @property
    def add_special_tokens(self) -> bool:
        """BOS and the like are added by the tokenizer for plain prompts; a chat template writes its own."""
        return not self.use_chat_template

    def format(self, prompt: str) -> str:
        """The prompt as the model reads it: wrapped in the chat template when one is used (bounded)."""
        if not self.use_chat_template:
            return prompt
        return render_chat(self.tokenizer, prompt)

    def encode(self, prompt: str) -> list[int]:
        """Token ids of one formatted prompt."""
        return self.tokenizer(self.format(prompt), add_special_tokens=self.add_special_tokens)["input_ids"]

    def decode(self, token_ids: list[int], stop: Sequence[str]) -> str:
        """The answer of generated token ids: special tokens dropped, cut before the first stop string."""
        return truncate_at_stop(self.tokenizer.decode(token_ids, skip_special_tokens=True), stop)
