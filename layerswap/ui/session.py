"""What each visitor owns, and what visitors share.

- `Visitor` (one per Gradio session: a browser tab, or an API client): the models the visitor loaded,
  its Stop flag, its last evaluation and export. The plan always comes from the visitor's own controls
  with each event. Its id is made by the server (unguessable) and names its folder.
- `Shared` (one per app process): the loaded models (one `Workbench` per trio, at most `capacity`),
  the lock that makes them one lane, the background start, and the visitors by session (`ui.visitors`:
  a bounded table that never drops a visitor with work in progress).

Loading a trio reads headers only (`Workbench.check`): the report, analysis, export and card need no
engine. The engine plan decides everything about serving (`engines.planning`, counting the engines of the
trio it replaces as released, which go before the new ones start) and `Workbench.start` starts what it says;
this module only decides when: behind the page when the plan is quick (`EnginePlan.quick`), otherwise when
answers are asked for (`engines`). The page's engine line comes from the running engines (`engine_status`).

Identity comes from the server, never from a handler's arguments: every event asks `Shared.visitor`
with the request's session, and a caller without a session gets a fresh identity of its own.

A workbench's merged model holds one plan at a time: `ensure_built` rebuilds it when the shared
merged model holds another visitor's plan, so answers always come from the asking visitor's plan.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from layerswap.core import scratch
from layerswap.serving.answering import releasing
from layerswap.core.errors import UserError
from layerswap.recipe.recipes import Recipe
from layerswap.core.runtime import Progress, background_priority, no_progress
from layerswap.serving.workbench import Workbench
from layerswap.ui.visitors import MAX_VISITORS, Key, Visitor, Visitors


@dataclass
class EngineStart:
    """A background start of one trio's engines: `answering` is set once answers are possible (or it failed)."""

    answering: threading.Event = field(default_factory=threading.Event)
    status: str = "starting the engines"
    error: str | None = None


class Shared:
    """Models shared by all visitors, loaded once per trio and used one job at a time."""

    def __init__(self, make_workbench: Callable[[], Workbench], capacity: int = 1, max_visitors: int = MAX_VISITORS,
                 root: Path | None = None):
        # transformers' lazy module cannot be set up by two threads at once ("cannot import name AutoTokenizer"
        # when a visitor's job and the background start first use it together): once, here, before either runs
        import transformers  # noqa: F401

        self.make_workbench = make_workbench
        self.capacity = max(1, capacity)
        self.lock = threading.RLock()  # the one lane (GPU or CPU): model-touching work runs under it
        self.ready = threading.Event()  # set when the background start is over (ok or failed)
        self.status = "Starting…"
        self.start_error: str | None = None
        self._wbs: OrderedDict[Key, Workbench] = OrderedDict()
        self._starting: dict[Key, EngineStart] = {}
        self.root = root or scratch.make("sessions")  # hosted mode: the served root (`ui.files.neutral_root`)
        self.visitors = Visitors(self.root, max_visitors)

    # ---- models ---------------------------------------------------------------------------
    def loaded(self, key: Key) -> Workbench | None:
        return self._wbs.get(key)

    def loaded_keys(self) -> list[Key]:
        """The trios held now (models in use: the Hub cache never prunes them)."""
        return list(self._wbs)

    def workbench(self, key: Key, force: bool = False, progress: Progress = no_progress,
                  after: Callable[[Workbench], None] | None = None) -> Workbench:
        """The workbench of `key`, checked (headers and the shared-base check) if new; models already loaded
        are dropped (oldest first, above `capacity`) only once the new ones passed, and before their engines
        start (their plan counted them as released). Quick engines start behind it, then `after` runs (e.g.
        building the opening plan)."""
        wb = self._wbs.get(key)
        if wb is not None:  # loaded: no need to wait for the lane (a first view while a job runs)
            try:
                self._wbs.move_to_end(key)
            except KeyError:  # dropped meanwhile by a load under the lock
                pass
            return wb
        with self.lock:
            wb = self._wbs.get(key)
            if wb is not None:
                self._wbs.move_to_end(key)
                return wb
            base, math, lang = key
            if not (math and lang):
                raise UserError("Give a math expert and a language expert, then press Load.")
            wb = self.make_workbench()
            evicted = list(self._wbs)[:max(0, len(self._wbs) - self.capacity + 1)]
            wb.check(math, lang, base or None, force=force, progress=progress,
                     releasing=releasing([self._wbs[k].answering_engines for k in evicted
                                          if self._wbs[k].answering_engines is not None]))
            for old_key in evicted:
                self._starting.pop(old_key, None)
                self._wbs.pop(old_key).close()
            self._wbs[key] = wb
            if wb.engine_plan is not None and wb.engine_plan.quick and not wb.engine_plan.played:
                self._start_engines(key, wb, after)
            return wb

    # ---- engines ----------------------------------------------------------------------------
    def _start_engines(self, key: Key, wb: Workbench, after: Callable[[Workbench], None] | None = None) -> None:
        """Start `wb`'s engines in a thread (transformers first when the plan says so, then vLLM); `after` runs
        once answers are possible."""
        st = self._starting[key] = EngineStart()

        def p(f: float, d: str) -> None:
            st.status = f"{d} ({f:.0%})"

        def ready() -> None:
            if after is not None:
                with self.lock:
                    after(wb)
            st.answering.set()

        def run() -> None:
            background_priority()  # the page's events first: engines that start behind it yield the cores
            try:
                if not wb.answering:
                    wb.start(p, lock=self.lock, ready=ready)
                else:
                    ready()
            except Exception as e:  # shown when answers are asked for; everything else keeps working
                st.error = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
                st.status = f"the engines did not start: {st.error}"
            finally:
                st.answering.set()

        threading.Thread(target=run, name="layerswap-engines", daemon=True).start()

    def engine_status(self, wb: Workbench) -> str:
        """The page's engine line: the engines running for `wb` (`Workbench.engine_note`, derived from them), or,
        before any answers, what the start is doing."""
        if wb.answering:
            return wb.engine_note
        key = next((k for k, w in self._wbs.items() if w is wb), None)
        st = self._starting.get(key) if key is not None else None
        return st.status if st is not None else ""

    def engines(self, key: Key, progress: Progress = no_progress, *, slow_ok: bool = False) -> Workbench:
        """The workbench of `key` with its engines answering: waits for a background start, else starts them
        here. Refused, with the numbers, when they do not fit, and (unless `slow_ok`: the Start engines button)
        when a question would take minutes on this machine."""
        wb = self._wbs.get(key)
        if wb is None:
            raise UserError("Load the models first.")
        st = self._starting.get(key)
        while st is not None and not st.answering.wait(0.5):
            progress(0.0, f"waiting for the engines: {st.status}")
        if wb.answering:
            return wb
        plan = wb.engine_plan
        if plan is not None and not plan.fits:
            raise UserError(plan.describe().replace("**", ""))
        if plan is not None and not plan.quick and not slow_ok:
            raise UserError(f"{plan.describe()} Press 'Start engines' to load them, then ask.".replace("**", ""))
        if st is not None and st.error:
            raise UserError(f"The engines did not start: {st.error}")
        with self.lock:
            if not wb.answering:
                wb.start(progress)
        return wb

    def ensure_built(self, wb: Workbench, recipe: Recipe, progress: Progress = no_progress) -> bool:
        """Build `recipe` unless the merged model already holds it; True when a build ran."""
        with self.lock:
            return wb.ensure_built(recipe, progress)

    def start_background(self, key: Key, after: Callable[[Workbench], None] | None = None) -> threading.Thread:
        """Check `key` in a thread, so the page is served at once; its engines then start behind it when they
        are quick, running `after` (the opening plan's build) once they answer."""

        def run() -> None:
            def p(f: float, d: str) -> None:
                self.status = f"Loading the default models: {d} ({f:.0%})"

            background_priority()
            t0 = time.perf_counter()
            try:
                self.workbench(key, progress=p, after=after)
                self.status = f"Models ready (checked in {time.perf_counter() - t0:.1f} s)."
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
        """Scratch folders first (no lock: a job holding the lane must not keep them on disk), then the models."""
        shutil.rmtree(self.root, ignore_errors=True)
        if os.environ.get("GRADIO_TEMP_DIR") == str(self.root):  # it was Gradio's cache (`ui.files`): not any more
            del os.environ["GRADIO_TEMP_DIR"]
        for wb in list(self._wbs.values()):
            wb.drop_scratch()
        if not self.lock.acquire(timeout=10):  # a job still runs: the process is ending, its engines with it
            return
        try:
            for wb in self._wbs.values():
                wb.close()
            self._wbs.clear()
        finally:
            self.lock.release()

    # ---- per visitor (`ui.visitors`) --------------------------------------------------------
    def visitor(self, session_hash: str | None, refs: Key = ("", "", "")) -> Visitor:
        """The visitor of a Gradio session, made on its first event with `refs` as its models."""
        return self.visitors.get(session_hash, refs)

    def folder(self, v: Visitor) -> Path:
        """The visitor's own folder (exports, downloads); nothing a visitor writes goes elsewhere."""
        return self.visitors.folder(v)

    def end(self, session_hash: str | None) -> None:
        """The tab was closed: its visitor and files go (once its running job ends)."""
        if session_hash:
            self.visitors.end(session_hash)
