"""Where layerswap keeps what it can recompute, and how it tells whether files changed.

`cache_dir(name)` is ``$LAYERSWAP_CACHE/<name>`` (default ``~/.cache/layerswap/<name>``).
`fingerprint(files)` is the cheap identity of a set of files (names, sizes, mtimes, and the
header bytes of safetensors files): caches are keyed by it and "same model?" checks compare it.
`content_fingerprint(files)` is the identity by content alone (no paths, no mtimes), the same in every
clone and on every machine: results files key their records by it. `content_hash(parts)` hashes small
files (configs, tokenizers) by their bytes, for "same shape / same tokenizer" checks across different folders.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

from layerswap.models.tensorfile import raw_header, read_header


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


FULL_HASH_BELOW = 256 << 20  # weight sets up to this size are hashed whole
SAMPLE_BYTES = 256
SAMPLE_EVERY = 4 << 20  # larger ones: windows at both ends of every tensor and one per this many bytes


def content_fingerprint(files: Iterable[Path], full_below: int = FULL_HASH_BELOW) -> str:
    """Identity of `files` by their names and content: every byte when they hold at most `full_below` bytes;
    else each file's size, its safetensors header and evenly spaced windows of every tensor's bytes (a
    fine-tune changes nearly every element of a tensor it trains, so a changed tensor changes the windows)."""
    files = sorted(Path(f) for f in files)
    whole = sum(f.stat().st_size for f in files) <= full_below
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}\0".encode())
        if whole or f.suffix != ".safetensors":
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            continue
        h.update(raw_header(f))
        with open(f, "rb") as fh:
            for e in read_header(f).values():
                k = 2 + e.nbytes // SAMPLE_EVERY
                span = max(0, e.nbytes - SAMPLE_BYTES)
                for i in range(k):
                    fh.seek(e.start + span * i // (k - 1))
                    h.update(fh.read(min(SAMPLE_BYTES, e.nbytes)))
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
