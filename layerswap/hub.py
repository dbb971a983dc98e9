"""Hugging Face Hub access helpers: is this a Hub id, and can the Hub be reached at all."""

from __future__ import annotations

import os
import re
import time

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def looks_like_hub_id(ref: str) -> bool:
    """``owner/name`` or ``owner/name@revision`` (never a path starting with ``.``, ``/`` or ``~``)."""
    return bool(_HUB_ID_RE.match(ref)) and not ref.startswith((".", "/", "~"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP check of ``$HF_ENDPOINT`` (host and port), so offline machines fail at once
    instead of after minutes of retries. ``HF_HUB_OFFLINE=1`` answers False without trying."""
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        port = url.port or (80 if url.scheme == "http" else 443)
    except ValueError:
        return False
    return _can_connect(url.hostname or "huggingface.co", port, timeout)


_CHECKED: dict[tuple[str, int], tuple[float, bool]] = {}
RECHECK_S = 60.0  # a long-running app sees the network come back (or go) within a minute


def _can_connect(host: str, port: int, timeout: float) -> bool:
    import socket

    seen = _CHECKED.get((host, port))
    if seen and time.monotonic() - seen[0] < RECHECK_S:
        return seen[1]
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        ok = True
    except OSError:
        ok = False
    _CHECKED[(host, port)] = (time.monotonic(), ok)
    return ok
