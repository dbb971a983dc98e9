"""Where work runs and how long work reports on itself: device choice, available RAM, progress callbacks."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from layerswap.core.errors import UserError

# progress(fraction done in [0, 1], what is happening now)
Progress = Callable[[float, str], None]
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def no_progress(fraction: float, desc: str) -> None:
    """The default progress callback: report nothing."""


def resolve_device(device: str | None, allowed: Sequence[str] = ("cpu", "cuda", "mps")) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; anything else is checked and kept.

    Raises UserError (with the fix) for an unknown device or a CUDA device torch cannot see.
    """
    device = (device or "auto").strip().lower()
    kind = device.split(":")[0]
    if device != "auto" and kind not in allowed:
        raise UserError(f"Unknown device {device!r}; use {', '.join(allowed)}" + (", cuda:N" if "cuda" in allowed else "")
                        + " or auto.")
    if device == "auto" or kind == "cuda":
        import torch

        if device == "auto":
            return "cuda" if "cuda" in allowed and torch.cuda.is_available() else "cpu"
        if not torch.cuda.is_available():
            raise UserError(f"device {device!r} was asked for, but torch sees no CUDA GPU; use cpu (or auto).")
    return device


def _meminfo(field: str) -> int | None:
    """Bytes of one field of Linux's /proc/meminfo (e.g. ``MemTotal``); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def ram_total() -> int | None:
    """Bytes of RAM in the machine (Linux's MemTotal); None where it cannot be read."""
    return _meminfo("MemTotal")


def ram_available() -> int | None:
    """Bytes of RAM available to new work (Linux's MemAvailable, else psutil); None when neither can say."""
    avail = _meminfo("MemAvailable")
    if avail is not None:
        return avail
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` while the block runs, then set back (torch has one setting per process:
    for work that runs one at a time, as the analysis does in the CLI and in the app's one lane).

    For work that brings its own threads onto the cores (the analysis's compiled lanes): torch's pool beside them
    oversubscribes the CPU, and each small torch operation then waits for a descheduled pool thread (measured on
    the 8B trio: 179 s instead of 65 s with the same CPU time)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


BACKGROUND_NICENESS = 10


def background_priority() -> bool:
    """Lower the calling thread's CPU priority (Linux: a thread's own nice value), for start-up work behind a
    served page: visitors' events then get the cores first. Threads it starts afterwards inherit it (vLLM's CPU
    workers, torch's pool if it makes one). Returns False where the system has no per-thread priority."""
    import os
    import threading

    if not hasattr(os, "setpriority") or os.uname().sysname != "Linux":
        return False
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICENESS))
    except OSError:
        return False
    return True
