"""A model's tokenizer files: which they are, and bounds on their sizes checked before anything parses them.

    check_tokenizer_folder(folder)   # UserError when a tokenizer file is larger than its vocabulary allows,
                                     # or one of its JSON files is not strict JSON
"""

from __future__ import annotations

import os
from pathlib import Path

from layerswap.core.bounds import MAX_CONFIG_INT, tokenizer_bytes, whole
from layerswap.core.errors import UserError
from layerswap.core.jsonfile import read_json

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.json")


def text_config(config: dict) -> dict:
    """The language model's part of a config (multimodal configs, e.g. Gemma 3, nest it)."""
    return config.get("text_config", config) if "num_hidden_layers" not in config else config


def vocab_size(config: object) -> int | None:
    """The config's vocab_size when it is a whole number in range (else None)."""
    v = text_config(config).get("vocab_size") if isinstance(config, dict) else None
    return v if whole(v, MAX_CONFIG_INT) else None


def check_tokenizer_sizes(folder: Path, config: object, ref: object) -> None:
    """Each tokenizer file of `folder` at most `bounds.tokenizer_bytes` for the config's vocabulary, checked
    before anything parses it (a 66 MB tokenizer.json for 373 tokens would take gigabytes to load)."""
    cap = tokenizer_bytes(vocab_size(config))
    for name in (*TOKENIZER_FILES, "added_tokens.json"):
        f = folder / name
        size = f.stat().st_size if f.is_file() else 0
        if size > cap:
            raise UserError(f"{ref}: its {name} is {size:,} bytes, more than the {cap:,} a tokenizer of "
                            f"{vocab_size(config) or 'unknown'} tokens may hold; re-download it or use the base's.")


def check_tokenizer_folder(folder: str | os.PathLike) -> int | None:
    """`check_tokenizer_sizes` for a model folder, its config read with the strict reader; returns the config's
    vocabulary size (None when it states none)."""
    folder = Path(folder)
    cfg = folder / "config.json"
    config = read_json(cfg) if cfg.is_file() else None
    check_tokenizer_sizes(folder, config, folder)
    for name in JSON_FILES:  # transformers parses them with Python's json: the strict reader first
        if (folder / name).is_file():
            read_json(folder / name, where=f"{folder}: its {name}")
    return vocab_size(config)
