"""The visitor table: one `Visitor` per Gradio session, bounded, never dropping work in progress.

- A visitor is made by the server on its session's first event (an unguessable id that names its folder).
- The table holds at most `capacity` visitors. A new session drops the least recently seen visitor that is
  *idle*: no job queued or running (`alive`, from the lane) and no export younger than `export_ttl`. When
  every visitor has work in progress the new session is refused (`FULL`), never someone else's work dropped.
- Gradio keeps per-session state of its own (`StateHolder`): `bound_state` caps it at the table's size and
  makes its eviction skip the sessions the table protects, so a flood of fresh sessions costs bounded memory
  and cannot reset an honest visitor's page state.
- A tab closed while its job runs (`end`) is dropped when the job ends; a dropped visitor's folder is gone
  and cannot be made again, so no folder outlives its visitor.
"""

from __future__ import annotations

import hashlib
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from layerswap.core.errors import UserError
from layerswap.serving.hosting import Limits

Key = tuple[str, str, str]  # base, math, lang references
MAX_VISITORS = Limits.visitors  # sessions remembered at once (`hosting.Limits`: the hosted numbers, in one table)
EXPORT_TTL = Limits.export_seconds  # seconds an export is kept for its visitor (Download, Push)
FULL = ("This server is full: {n} visitors have work in progress. Try again in a few minutes, or run layerswap "
        "on your own machine.")
ENDED = "Your session ended (the tab was closed or the server forgot it): reload the page."


def new_sid() -> str:
    """A visitor id made by the server: unguessable, and safe as a folder name."""
    return secrets.token_hex(16)


FAMILY_FILES = ("layerswap-family", "family-download")  # a family's export and its zip (`ui.family_views`)


@dataclass
class Visitor:
    sid: str = field(default_factory=new_sid)
    refs: Key = ("", "", "")
    force: bool = False
    stop: threading.Event = field(default_factory=threading.Event)  # set by the visitor's Stop button
    busy: int = 0  # handlers running for the visitor
    job: Any = None  # its one heavy job (`ui.lane.Admission`): admitted when it joined the queue
    session: str = ""  # its Gradio session (for Gradio's own state and queue)
    key: str = ""  # its place in the table (a digest of the session)
    last_eval: Any = None  # the visitor's latest EvalReport
    last_export: str | None = None  # the visitor's latest export folder (what Push to Hub uploads)
    exported_at: float = 0.0  # time.monotonic() of that export
    family: Any = None  # the family it loaded (`ui.family.Loaded`), checked
    family_lang: str | None = None  # the family's language the analysis tab shows (`ui.family_views`)
    family_analyses: Any = None  # (family, ks, code -> Analysis) of that family (`ui.family_views`)
    family_exported_at: float = 0.0  # time.monotonic() of its family's export (`FAMILY_FILES`), 0: none
    eval_recipe: dict | None = None  # the merged model's recipe in `last_eval` (its results go on that card)
    closing: bool = False  # its tab closed while a job ran: dropped when the job ends
    dropped: bool = False


def _key(session_hash: str) -> str:
    return hashlib.sha256(session_hash.encode("utf-8", "replace")).hexdigest()


class Visitors:
    """Visitors by session, at most `capacity`, each with a folder under `root`."""

    def __init__(self, root: Path, capacity: int = MAX_VISITORS, export_ttl: float = EXPORT_TTL):
        self.root = root
        self.capacity = max(1, capacity)
        self.export_ttl = export_ttl
        # a job queued or running, or an event Gradio still holds (set from the lane by `Context`)
        self.alive: Callable[[Visitor], bool] = lambda v: v.job is not None
        self._by_key: OrderedDict[str, Visitor] = OrderedDict()
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._by_key)

    def protected(self, v: Visitor) -> bool:
        """Work in progress: a handler running, a job queued, running or still sending its reply (its files), or
        an export younger than the export TTL."""
        now = time.monotonic()
        young = (v.last_export is not None and now - v.exported_at < self.export_ttl) or (
            v.family_exported_at > 0 and now - v.family_exported_at < self.export_ttl)
        return v.busy > 0 or self.alive(v) or young

    def protected_session(self, session_hash: str) -> bool:
        v = self._by_key.get(_key(session_hash))
        return v is not None and self.protected(v)

    def get(self, session_hash: str | None, refs: Key = ("", "", "")) -> Visitor:
        """The visitor of a Gradio session (made on its first event, with `refs` as its models); a caller
        without a session gets a fresh one. Sessions are keyed by a digest, so a long hash costs nothing."""
        key = _key(session_hash) if session_hash else new_sid()
        with self._lock:
            v = self._by_key.get(key)
            if v is None:
                while len(self._by_key) >= self.capacity:
                    idle = next((k for k, x in self._by_key.items() if not self.protected(x)), None)
                    if idle is None:
                        raise UserError(FULL.format(n=len(self._by_key)))
                    self._drop(idle)
                v = self._by_key[key] = Visitor(refs=refs, session=(session_hash or "")[:200], key=key)
            self._by_key.move_to_end(key)
            return v

    def folder(self, v: Visitor) -> Path:
        """The visitor's own folder (exports, downloads); nothing a visitor writes goes elsewhere."""
        if v.dropped:
            raise UserError(ENDED)
        d = self.root / v.sid
        d.mkdir(parents=True, exist_ok=True)
        return d

    def expire_exports(self) -> None:
        """Remove the exports (and their zips) older than the export TTL of visitors without a running job."""
        now = time.monotonic()
        with self._lock:
            for v in list(self._by_key.values()):
                if v.last_export and v.busy <= 0 and now - v.exported_at >= self.export_ttl:
                    for name in ("layerswap-merge", "download"):
                        shutil.rmtree(self.root / v.sid / name, ignore_errors=True)
                    v.last_export = None
                if v.family_exported_at and v.busy <= 0 and now - v.family_exported_at >= self.export_ttl:
                    for name in FAMILY_FILES:
                        shutil.rmtree(self.root / v.sid / name, ignore_errors=True)
                    v.family_exported_at = 0.0

    def end(self, session_hash: str) -> None:
        """The tab was closed: its visitor and files go (once its running job ends)."""
        with self._lock:
            v = self._by_key.get(_key(session_hash))
            if v is None:
                return
            v.stop.set()
            if v.busy > 0:
                v.closing = True
            else:
                self._drop(v.key)

    def release(self, v: Visitor) -> None:
        """A job of `v` ended: a visitor whose tab closed meanwhile goes now."""
        with self._lock:
            if v.closing and v.busy <= 0 and not v.dropped:
                self._drop(v.key)

    def _drop(self, key: str) -> None:
        v = self._by_key.pop(key, None)
        if v is not None:
            v.dropped = True
            v.stop.set()
            shutil.rmtree(self.root / v.sid, ignore_errors=True)
            self.forget(v.session)

    forget: Callable[[str], None] = staticmethod(lambda session: None)  # Gradio's state of a dropped session

    def bound_state(self, demo) -> None:
        """Cap Gradio's per-session state at the table's size, evicting (oldest first) only sessions the table
        does not protect, and drop a session's state with its visitor. Call after `launch`."""
        holder = demo.state_holder
        holder.capacity = self.capacity

        def update(session_id: str) -> None:
            with holder.lock:
                if session_id in holder.session_data:
                    holder.session_data.move_to_end(session_id)
                while len(holder.session_data) > holder.capacity:
                    old = next((s for s in holder.session_data if s != session_id
                                and not self.protected_session(s)), None)
                    if old is None:
                        break
                    holder.session_data.pop(old, None)
                    holder.time_last_used.pop(old, None)

        def forget(session: str) -> None:
            with holder.lock:
                holder.session_data.pop(session, None)
                holder.time_last_used.pop(session, None)

        holder.update = update
        self.forget = forget
