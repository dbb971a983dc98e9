"""Reading a JSON file a model brings (config.json, adapter_config.json, tokenizer_config.json, an index, a
safetensors header): size and nesting depth bounded before parsing, NaN and Infinity refused, and every
failure one `UserError` line that names the file.

    cfg = read_json(folder / "config.json")             # a dict, list, ... or UserError
    header = loads_json(raw, "model.safetensors header") # bytes or text already read
    header = parse_json(raw)                             # the same, ValueError (one line) when refused

Python's `json` accepts ``NaN`` and ``Infinity`` (not JSON) and recurses once per bracket, so 100,000
nested brackets end in a RecursionError; both are refused here with the file's name.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .errors import UserError

MAX_JSON_BYTES = 64 * 2**20  # a model's JSON files (configs, indexes, tokenizer configs) are far smaller
MAX_JSON_DEPTH = 64  # nesting of arrays and objects; real configs nest a handful of levels
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_INNERMOST = re.compile(rb"\[\]|\{\}")


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _depth_exceeds(raw: bytes, limit: int) -> bool:
    """Whether `raw` nests arrays and objects deeper than `limit` (strings skipped; linear passes, one per
    level, at most `limit` + 1 of them; unbalanced brackets are left to the parser)."""
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", raw))
    for _ in range(limit):
        if not brackets:
            return False
        shorter = _INNERMOST.sub(b"", brackets)
        if len(shorter) == len(brackets):
            return False  # unbalanced: the parser says where
        brackets = shorter
    return bool(_INNERMOST.search(brackets))


def parse_json(raw: bytes | str, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> object:
    """`raw` parsed as strict JSON (no NaN/Infinity, at most `max_depth` levels, `max_bytes` long); ValueError
    with a short reason (one line) otherwise."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    if len(data) > max_bytes:
        raise ValueError(f"{len(data):,} bytes, at most {max_bytes:,} are read")
    if _depth_exceeds(data, max_depth):
        raise ValueError(f"more than {max_depth} levels of nested brackets")
    try:
        return json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(str(e).splitlines()[0][:120] if str(e) else type(e).__name__) from None


def loads_json(raw: bytes | str, where: str, *, fix: str = "re-download or re-export it",
               max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> object:
    """`parse_json`, its refusal the UserError ``WHERE is not valid JSON (why); FIX.``"""
    try:
        return parse_json(raw, max_bytes=max_bytes, max_depth=max_depth)
    except ValueError as e:
        raise UserError(f"{where} is not valid JSON ({e}); {fix}.") from None


def read_json(path: str | os.PathLike, *, where: str | None = None, fix: str = "re-download or re-export it",
              max_bytes: int = MAX_JSON_BYTES) -> object:
    """The JSON file at `path` (`loads_json`), its size checked before a byte is read."""
    path = Path(path)
    where = where or str(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise UserError(f"{where} is {size:,} bytes; at most {max_bytes:,} are read ({fix}).")
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{where} cannot be read ({e.strerror or type(e).__name__}); {fix}.") from None
    return loads_json(raw, where, fix=fix, max_bytes=max_bytes)
