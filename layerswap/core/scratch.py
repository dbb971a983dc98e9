"""Scratch folders (the merge vLLM loads, the app's visitor folders): made with an owner, checked for disk
before anything big is written, and removed on exit or, after a crash, at the next start.

    d = scratch.make("serving")              # $LAYERSWAP_SCRATCH or the temp folder; an OWNER file holds our pid
    scratch.check_disk(15e9, d, "the merged model for vLLM")   # UserError with the numbers when it cannot fit
    scratch.clean_stale()                    # folders of processes that no longer run

`LAYERSWAP_AVAILABLE_DISK` (bytes) caps what the checks see as free, so a test can play a small disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from layerswap.core.errors import UserError

PREFIX = "layerswap-"
OWNER = "OWNER"
_GB = 1e9


def root() -> Path:
    """Where scratch folders go: ``$LAYERSWAP_SCRATCH``, else the system's temp folder."""
    return Path(os.environ.get("LAYERSWAP_SCRATCH") or tempfile.gettempdir())


def make(kind: str, base: Path | None = None) -> Path:
    """A new scratch folder ``layerswap-<kind>-*`` owned by this process (under `base`, default `root()`)."""
    base = base or root()
    base.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-", dir=base))
    (d / OWNER).write_text(str(os.getpid()))
    return d


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def clean_stale(base: Path | None = None) -> list[Path]:
    """Remove scratch folders whose owner process no longer runs (left by a crash or a kill); returns them."""
    gone = []
    for d in (base or root()).glob(f"{PREFIX}*"):
        owner = d / OWNER
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            continue  # not ours, or being made right now
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def free_bytes(path: str | os.PathLike) -> int:
    """Free disk at `path` (its nearest existing parent), capped by ``$LAYERSWAP_AVAILABLE_DISK`` when set."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(p).free
    cap = os.environ.get("LAYERSWAP_AVAILABLE_DISK")
    return min(free, int(float(cap))) if cap else free


def check_disk(need: int, path: str | os.PathLike, what: str) -> None:
    """Refuse, with the numbers, to write `need` bytes for `what` under `path` when the disk has less free."""
    have = free_bytes(path)
    if need > have:
        raise UserError(f"Writing {what} needs {need / _GB:.1f} GB of disk, more than the {have / _GB:.1f} GB free "
                        f"there; nothing was written. Free disk, or point LAYERSWAP_SCRATCH at a larger disk.")
