"""Where work runs and how long work reports on itself: device choice, available RAM, progress callbacks."""

from __future__ import annotations

from typing import Callable, Sequence

from .errors import UserError

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


def ram_available() -> int | None:
    """Bytes of RAM available to new work (Linux's MemAvailable, else psutil); None when neither can say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)
