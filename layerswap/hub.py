"""Hugging Face Hub access helpers: is this a Hub id, and can the Hub be reached at all."""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def looks_like_hub_id(ref: str) -> bool:
    """``owner/name`` or ``owner/name@revision`` (never a path starting with ``.``, ``/`` or ``~``)."""
    return bool(_HUB_ID_RE.match(ref)) and not ref.startswith((".", "/", "~"))


def hub_id_of(ref: str) -> str | None:
    """``owner/name`` when `ref` names a Hub model (not a local folder of that name), else None."""
    return ref.split("@")[0] if looks_like_hub_id(ref) and not Path(ref).expanduser().exists() else None


@lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP check, so offline machines fail at once instead of after minutes of retries."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False
