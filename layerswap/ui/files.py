"""Files visitors get back, and the disk they may use (hosted mode).

- `neutral_root()`: one folder ``layerswap-files-*`` under ``/tmp`` (or ``$LAYERSWAP_FILES_ROOT``), made
  Gradio's cache (``GRADIO_TEMP_DIR``) before the page is built. The visitors' folders live in it, so a file a
  handler returns is already in Gradio's cache: it is served in place (the same export once, never a copy per
  request) and a reply names only that neutral root, never the server's own folders. It is removed at exit
  (`Shared.close`) and, after a crash, at the next start (`scratch.clean_stale`).
- `Budget`: before an export, the visitor's folder and all visitors' folders together must stay within
  `Limits.visitor_disk_bytes` and `Limits.disk_bytes`; refused with the numbers otherwise.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from layerswap.core import scratch
from layerswap.core.errors import UserError
from layerswap.serving.hosting import Limits

_GB = 1e9


def files_base() -> Path:
    """Where the served root goes: ``$LAYERSWAP_FILES_ROOT``, else ``/tmp`` (a name that says nothing about
    the server), else the temp folder."""
    env = os.environ.get("LAYERSWAP_FILES_ROOT")
    if env:
        return Path(env)
    tmp = Path("/tmp")
    return tmp if tmp.is_dir() and os.access(tmp, os.W_OK) else Path(tempfile.gettempdir())


def neutral_root() -> Path:
    """A fresh served root, made Gradio's cache for this process (call before the page is built)."""
    root = scratch.make("files", files_base())
    os.environ["GRADIO_TEMP_DIR"] = str(root)
    return root


def used_bytes(path: Path) -> int:
    """Bytes of the files under `path` (links not followed)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass  # removed meanwhile
    return total


@dataclass(frozen=True)
class Budget:
    """The disk visitors may use: each visitor's folder, and all of them (the served root) together."""

    limits: Limits

    def check(self, need: int, own: Path, root: Path, what: str = "this export") -> None:
        """Refuse, with the numbers, writing `need` more bytes into the visitor folder `own` under `root`."""
        mine, everyone = used_bytes(own), used_bytes(root)
        if mine + need > self.limits.visitor_disk_bytes:
            raise UserError(f"{what.capitalize()} needs {need / _GB:.2f} GB; with your other files ({mine / _GB:.2f} "
                            f"GB) that is over this server's {self.limits.visitor_disk_bytes / _GB:.0f} GB per visitor. "
                            "Nothing was written; push a smaller model, or run layerswap on your own machine.")
        if everyone + need > self.limits.disk_bytes:
            raise UserError(f"This server's disk for visitors' files is full ({everyone / _GB:.1f} of "
                            f"{self.limits.disk_bytes / _GB:.0f} GB used); nothing was written. Try again later: "
                            f"files are kept {self.limits.export_seconds // 60} minutes after their export, then go.")
