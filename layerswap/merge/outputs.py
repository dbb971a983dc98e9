"""Where an output may go: never onto, above or inside an input, and replacing only earlier exports.

One set of rules for the library, the CLI and the app, checked before anything is written:

- an output folder or file must not resolve equal to, above (containing) or inside any input
  (experts, base, an adapter and the base it was merged into, the MGSM folder);
- an existing output folder is replaced (`overwrite`) only when an earlier export wrote it, i.e.
  it holds `layerswap.json`; anything else is refused and left alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Protocol

from layerswap.core.errors import UserError


class Input(Protocol):
    """Where a model input lives (a `checkpoints.Checkpoint` is one; typed here so outputs sits below it)."""

    path: Path
    adapter: str | None
    adapter_base: str | None


EXPORT_MARK = "layerswap.json"  # written by every export; the only folders --overwrite may replace


def input_paths(*checkpoints: Input | None, extra: Iterable[str | os.PathLike | None] = ()) -> list[Path]:
    """Every folder the inputs live in: the checkpoints, their adapters and adapter bases, and the
    local paths in `extra` (entries that are not local paths, such as Hub ids, are skipped)."""
    paths: list[str | os.PathLike] = []
    for ck in checkpoints:
        if ck is None:
            continue
        paths.append(ck.path)
        paths += [p for p in (ck.adapter, ck.adapter_base) if p]
    paths += [p for p in extra if p and Path(p).expanduser().exists()]
    return [Path(p).expanduser().resolve() for p in paths]


def _relation(out: Path, inp: Path) -> str | None:
    if out == inp:
        return "is"
    if out in inp.parents:
        return "contains"
    if inp in out.parents:
        return "is inside"
    return None


def _refuse_overlap(out: Path, inputs: Iterable[Path], shown: str) -> None:
    for inp in inputs:
        rel = _relation(out, inp)
        if rel:
            raise UserError(f"The output {shown} {rel} an input ({inp.name or inp}); nothing was written. "
                            "Choose a folder outside the models and data being read.")


def check_output_folder(out: str | os.PathLike, inputs: Iterable[Path], overwrite: bool = False,
                        mark: str = EXPORT_MARK) -> Path:
    """The resolved output folder, or UserError when writing there could touch an input or foreign data
    (`overwrite` replaces only a folder holding `mark`: an export, or a family's folder of exports)."""
    shown = str(out)
    path = Path(out).expanduser().resolve()
    _refuse_overlap(path, inputs, shown)
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{shown} exists and is not a folder; choose a new folder.")
        if any(path.iterdir()):
            if not overwrite:
                raise UserError(f"{shown} already exists; choose a new folder or pass --overwrite.")
            if not (path / mark).is_file():
                raise UserError(f"{shown} is not an earlier layerswap export (no {mark}); --overwrite "
                                "replaces only those. Nothing was touched: choose a new folder.")
    return path


def check_output_file(out: str | os.PathLike, inputs: Iterable[Path]) -> Path:
    """The resolved output file, or UserError when it is an input, inside one, or a folder."""
    shown = str(out)
    path = Path(out).expanduser().resolve()
    _refuse_overlap(path, inputs, shown)
    if path.is_dir():
        raise UserError(f"{shown} is a folder; give a file name.")
    if not path.parent.is_dir():
        raise UserError(f"Cannot write {shown}: its folder does not exist.")
    return path
