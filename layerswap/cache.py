"""Where layerswap keeps what it can recompute, and how it tells whether files changed.

`cache_dir(name)` is ``$LAYERSWAP_CACHE/<name>`` (default ``~/.cache/layerswap/<name>``).
`fingerprint(files)` is the cheap identity of a set of files (names, sizes, mtimes, and the
header bytes of safetensors files): caches are keyed by it and "same model?" checks compare it.
`content_hash(parts)` hashes small files (configs, tokenizers) by their bytes, for "same shape /
same tokenizer" checks across different folders.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

from .tensorfile import raw_header


def cache_dir(name: str) -> Path:
    """A folder for one kind of cached result (analysis, merged adapters, demo models)."""
    return Path(os.environ.get("LAYERSWAP_CACHE") or Path.home() / ".cache" / "layerswap") / name


def fingerprint(files: Iterable[Path]) -> str:
    """Names, sizes, mtimes (and safetensors header bytes) of `files`: changes when any file does."""
    h = hashlib.sha256()
    for f in sorted(Path(f) for f in files):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        if f.suffix == ".safetensors":
            h.update(raw_header(f))
    return h.hexdigest()[:20]


def content_hash(parts: Iterable[tuple[str, bytes]]) -> str:
    """A hash of named byte strings (file name and contents, or a normalised config)."""
    h = hashlib.sha256()
    for name, data in parts:
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()[:20]


def prune(folder: Path, pattern: str, keep: int) -> None:
    """Keep the `keep` most recently written files matching `pattern` in `folder`."""
    files = sorted(folder.glob(pattern), key=lambda f: f.stat().st_mtime, reverse=True)
    for f in files[keep:]:
        f.unlink(missing_ok=True)
