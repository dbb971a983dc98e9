"""The results file of a sweep: one JSON line per finished point, appended and fsynced at once.

Each line is a complete record (its `key` identifies the point: experts' fingerprints, recipe,
test set and evaluation settings). Reading tolerates exactly one kind of damage, the one an
interrupted write leaves: a last line without its newline or that does not parse. `ResultsLog`
(the writer) cuts such a line off before appending, so the point is simply run again; a damaged
line anywhere else is refused with its line number. A point already in the file is never written
twice; `load_results` keeps the first record of a key.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from layerswap.core.errors import UserError

FORMAT = 1


def point_key(identity: dict) -> str:
    """A stable id for what a record measures (canonical JSON, hashed)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:24]


def _scan(path: Path) -> tuple[list[dict], int, str | None]:
    """Records, the byte length of the good part, and what was wrong with a damaged last line (None: nothing)."""
    data = path.read_bytes()
    rows: list[dict] = []
    good = 0
    lines = data.split(b"\n")
    for i, raw in enumerate(lines):
        last = i == len(lines) - 1
        if last and raw == b"":
            break  # the file ends with a newline
        problem = None
        if last:
            problem = "was cut off while being written (no newline)"
        else:
            try:
                row = json.loads(raw)
                if not isinstance(row, dict) or "key" not in row:
                    problem = "is not a results record"
            except (json.JSONDecodeError, UnicodeDecodeError):
                problem = "is not valid JSON"
        if problem is not None:
            if last or all(x.strip() == b"" for x in lines[i + 1:]):
                return rows, good, f"line {i + 1} {problem}"
            raise UserError(f"{path}: line {i + 1} {problem}, and records follow it: the file was edited or damaged. "
                            "Move it aside (the sweep then starts afresh) or delete that line.")
        rows.append(row)
        good += len(raw) + 1
    return rows, good, None


def load_results(path: str | os.PathLike) -> list[dict]:
    """Every record of a results file, in order, one per point (a damaged last line is left out)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such results file.")
    rows, _, _ = _scan(path)
    seen: set[str] = set()
    out = []
    for r in rows:
        if r["key"] not in seen:
            seen.add(r["key"])
            out.append(r)
    return out


class ResultsLog:
    """Appends records to a results file, held by one writer at a time (an advisory lock on ``FILE.lock``)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.path.with_name(self.path.name + ".lock"), "a")  # noqa: SIM115 (held until close)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise UserError(f"{self.path} is being written by another sweep right now; wait for it or stop it.") from None
        self.repaired: str | None = None
        rows: list[dict] = []
        if self.path.exists():
            rows, good, self.repaired = _scan(self.path)
            if self.repaired:
                with open(self.path, "r+b") as f:
                    f.truncate(good)
                    f.flush()
                    os.fsync(f.fileno())
        self.rows: dict[str, dict] = {}
        for r in rows:
            self.rows.setdefault(r["key"], r)

    def __contains__(self, key: str) -> bool:
        return key in self.rows

    def append(self, row: dict[str, Any]) -> None:
        """Write one record as one line and fsync it; a key already present is not written again."""
        if row["key"] in self.rows:
            return
        line = (json.dumps({"format": FORMAT, **row}, separators=(",", ":"), allow_nan=False) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        self.rows[row["key"]] = {"format": FORMAT, **row}

    def close(self) -> None:
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()

    def __enter__(self) -> "ResultsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
