"""Hugging Face Hub access helpers: is this a Hub id, can the Hub be reached at all, and what went wrong
(`hub_error`: in a few words, without the Hub's address)."""

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


_URL = re.compile(r"[a-zA-Z][\w+.-]*://\S+")


def hub_error(e: BaseException) -> str:
    """Why a Hub call failed, for a message: the error's kind, its HTTP status and its first line with every
    address (the Hub endpoint, a file's URL) and request id left out."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    first = re.sub(r"\s*\(Request ID:[^)]*\)", "", _URL.sub("(address)", first))
    first = re.sub(r"host='?[^,)\s']+'?", "host=(address)", first)[:200]
    head = f"{type(e).__name__}, HTTP {status}" if status else type(e).__name__
    return f"{head}: {first}" if first and first != head else head
