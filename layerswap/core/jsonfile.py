"""Reading a JSON file a model brings (config.json, adapter_config.json, tokenizer_config.json, an index, a
safetensors header): size, nesting depth and the number of arrays and objects bounded before parsing, NaN and Infinity refused, and every
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
from pathlib import Path

from layerswap.core.errors import UserError

MAX_JSON_BYTES = 16 * 2**20  # a model's JSON files are far smaller (DeepSeek-V3's index: 9 MB)
MAX_JSON_CONTAINERS = 1_000_000  # arrays and objects in one file (a header: 3 per tensor), so parsed it stays small
MAX_JSON_DEPTH = 64  # nesting of arrays and objects; real configs nest a handful of levels
_QUOTE, _OPEN_SQUARE, _OPEN_CURLY, _CLOSE_SQUARE, _CLOSE_CURLY = (ord(c) for c in '"[{]}')
_CHUNK = 2**18


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _nesting(raw: bytes) -> tuple[int, int]:
    """The deepest nesting of arrays and objects in `raw` and how many there are, brackets inside strings not
    counted: escapes blanked (``\\\\`` then ``\\"``), then running sums over the bytes, `_CHUNK` at a time (linear,
    a few MB of work space whatever the file; invalid JSON may be misjudged, and the parser refuses it)."""
    import numpy as np

    data = np.frombuffer(raw.replace(b"\\\\", b"__").replace(b'\\"', b"__"), dtype=np.uint8)
    depth = deepest = opened = quotes = 0
    for at in range(0, len(data), _CHUNK):
        part = data[at:at + _CHUNK]
        quote = part == _QUOTE
        outside = ((quotes + np.cumsum(quote)) % 2 == 0) & ~quote
        opens = outside & ((part == _OPEN_SQUARE) | (part == _OPEN_CURLY))
        closes = outside & ((part == _CLOSE_SQUARE) | (part == _CLOSE_CURLY))
        running = depth + np.cumsum(opens.astype(np.int32) - closes)
        deepest, opened = max(deepest, int(running.max())), opened + int(opens.sum())
        depth, quotes = int(running[-1]), quotes + int(quote.sum())
    return deepest, opened


def parse_json(raw: bytes | str, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH,
               **hooks) -> object:
    """`raw` parsed as strict JSON (no NaN/Infinity, at most `max_depth` levels, `max_bytes` long); ValueError
    with a short reason (one line) otherwise. `hooks` go to `json.loads` (`object_pairs_hook`, `parse_int`)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    if len(data) > max_bytes:
        raise ValueError(f"{len(data):,} bytes, at most {max_bytes:,} are read")
    deepest, containers = _nesting(data)
    if deepest > max_depth:
        raise ValueError(f"more than {max_depth} levels of nested brackets")
    if containers > MAX_JSON_CONTAINERS:
        raise ValueError(f"{containers:,} arrays and objects, at most {MAX_JSON_CONTAINERS:,} are read")
    try:
        return json.loads(data, parse_constant=_refuse_constant, **hooks)
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
