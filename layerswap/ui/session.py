"""What each visitor owns, and what visitors share.

- `Visitor` (one per browser tab, kept in the page's `gr.State`): the models the visitor loaded and
  their last evaluation. The plan always comes from the visitor's own controls with each event.
- `Shared` (one per app process): the loaded models (one `Workbench` per trio, at most `capacity`),
  the lock that makes them one lane, the background start, per-visitor cancel flags and folders.

A workbench's merged model holds one plan at a time: `ensure_built` rebuilds it when the shared
merged model holds another visitor's plan, so answers always come from the asking visitor's plan.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import UserError
from ..recipes import Recipe
from ..runtime import Progress, no_progress
from ..workbench import Workbench

Key = tuple[str, str, str]  # base, math, lang references


@dataclass
class Visitor:
    sid: str
    refs: Key = ("", "", "")
    force: bool = False
    last_eval: Any = None  # the visitor's latest EvalReport
    last_export: str | None = None  # the visitor's latest export folder (what Push to Hub uploads)
    eval_recipe: dict | None = None  # the merged model's recipe in `last_eval` (its results go on that card)


def safe_sid(session_hash: str | None) -> str:
    """A folder-safe visitor id from Gradio's session hash (API clients choose theirs)."""
    sid = re.sub(r"[^A-Za-z0-9_-]", "", session_hash or "")[:64]
    return sid or "anonymous"


def cancellable(progress: Progress, flag: threading.Event) -> Progress:
    """A progress callback that stops the job (UserError) once the visitor pressed Stop."""

    def p(fraction: float, desc: str) -> None:
        if flag.is_set():
            raise UserError("Stopped. Nothing was changed; the models stay loaded.")
        progress(fraction, desc)

    return p


def same_recipe(wb: Workbench, recipe: Recipe) -> bool:
    """Does the workbench's merged model hold `recipe`?"""
    return wb.recipe is not None and wb.recipe.to_dict() == recipe.to_dict()


class Shared:
    """Models shared by all visitors, loaded once per trio and used one job at a time."""

    def __init__(self, make_workbench: Callable[[], Workbench], capacity: int = 1):
        self.make_workbench = make_workbench
        self.capacity = max(1, capacity)
        self.lock = threading.RLock()  # the one lane (GPU or CPU): model-touching work runs under it
        self.ready = threading.Event()  # set when the background start is over (ok or failed)
        self.status = "Starting…"
        self.start_error: str | None = None
        self._wbs: OrderedDict[Key, Workbench] = OrderedDict()
        self._cancel: dict[str, threading.Event] = {}
        self.root = Path(tempfile.mkdtemp(prefix="layerswap-sessions-"))

    # ---- models ---------------------------------------------------------------------------
    def loaded(self, key: Key) -> Workbench | None:
        return self._wbs.get(key)

    def workbench(self, key: Key, force: bool = False, progress: Progress = no_progress) -> Workbench:
        """The workbench of `key`, loading it if needed. Checks run first; models already loaded are
        dropped (oldest first, above `capacity`) only once the new ones passed them."""
        with self.lock:
            wb = self._wbs.get(key)
            if wb is not None:
                self._wbs.move_to_end(key)
                return wb
            base, math, lang = key
            if not (math and lang):
                raise UserError("Give a math expert and a language expert, then press Load.")
            wb = self.make_workbench()
            wb.check(math, lang, base or None, force=force, progress=progress)
            while len(self._wbs) >= self.capacity:
                _, old = self._wbs.popitem(last=False)
                old.close()
            try:
                wb.start(progress)
            except BaseException:
                wb.close()
                raise
            self._wbs[key] = wb
            return wb

    def ensure_built(self, wb: Workbench, recipe: Recipe, progress: Progress = no_progress) -> bool:
        """Build `recipe` unless the merged model already holds it; True when a build ran."""
        with self.lock:
            if same_recipe(wb, recipe) and "merged" in wb.engines:
                return False
            wb.build(recipe, progress=progress)
            return True

    def start_background(self, key: Key, after: Callable[[Workbench], None] | None = None) -> threading.Thread:
        """Load `key` (and run `after`) in a thread, so the page is served at once."""

        def run() -> None:
            def p(f: float, d: str) -> None:
                self.status = f"Loading the default models: {d} ({f:.0%})"

            t0 = time.perf_counter()
            try:
                wb = self.workbench(key, progress=p)
                if after is not None:
                    after(wb)
                self.status = f"Models ready (loaded in {time.perf_counter() - t0:.0f} s)."
            except Exception as e:  # shown on the page; the visitor can load other models
                self.start_error = f"{type(e).__name__}: {e}" if not isinstance(e, UserError) else str(e)
                self.status = f"Loading the default models failed: {self.start_error}"
            finally:
                self.ready.set()

        t = threading.Thread(target=run, name="layerswap-start", daemon=True)
        t.start()
        return t

    def wait_ready(self, progress: Progress = no_progress, timeout: float = 3600) -> None:
        """Block until the background start is over, showing its status."""
        deadline = time.time() + timeout
        while not self.ready.wait(0.5):
            progress(0.0, self.status)
            if time.time() > deadline:
                raise UserError("The default models are still loading; try again in a minute.")

    def close(self) -> None:
        with self.lock:
            for wb in self._wbs.values():
                wb.close()
            self._wbs.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- per visitor ----------------------------------------------------------------------
    def cancel_flag(self, sid: str) -> threading.Event:
        return self._cancel.setdefault(sid, threading.Event())

    def folder(self, sid: str) -> Path:
        """The visitor's own folder (exports, downloads); nothing a visitor writes goes elsewhere."""
        d = self.root / safe_sid(sid)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def end(self, sid: str) -> None:
        """The tab was closed: its files and flag go."""
        self._cancel.pop(sid, None)
        shutil.rmtree(self.root / safe_sid(sid), ignore_errors=True)
