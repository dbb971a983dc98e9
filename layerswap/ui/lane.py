"""The fair lane: model-touching ("heavy") events share one queue lane (`LANE`, one job at a time); in hosted
mode each visitor has at most one of them queued or running, and each kind has a time limit.

- Admission happens when the event joins Gradio's queue (its `validator`), so a second heavy job is refused at
  once with `BUSY` and never takes a queue slot; one visitor can hold one slot, never the queue.
- An admission whose event left the queue without running (the client went away) lapses: it is alive while
  it runs, for `GRACE` seconds after joining, or while Gradio still holds an event of that session.
- Quick events (the page's opening, questions, preview, browse, Stop) skip the queue (``queue=False``), so a
  full lane never answers them 503.
- `time_limit` is each kind's time limit in hosted mode (`hosting.JOB_SECONDS`): past it the job is stopped as
  the visitor's Stop would.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import gradio as gr

from layerswap.core.errors import UserError
from layerswap.serving.hosting import DEFAULT_JOB_SECONDS, JOB_SECONDS

BUSY = "You already have a job running: Stop it or wait for it to finish, then try again."
GRACE = 10.0  # seconds an admitted event may take to appear in Gradio's queue


def queue_size(shared) -> int:
    """Gradio's queue: one heavy job per remembered visitor and 16 more, so one visitor never fills it (quick
    events do not queue at all)."""
    return shared.visitors.capacity + 16


def time_limit(kind: str) -> int:
    """Seconds a heavy job of `kind` may run on a hosted server."""
    return JOB_SECONDS.get(kind, DEFAULT_JOB_SECONDS)


def timed_out(kind: str) -> str:
    return (f"Stopped: this server runs a {kind.replace('_', ' ')} for at most {time_limit(kind) // 60} minutes. "
            "Ask for less (fewer questions, a smaller model), or run layerswap on your own machine.")


@dataclass
class Admission:
    """A visitor's one heavy job: admitted when it joined the queue, `started` once its handler runs."""

    at: float = field(default_factory=time.monotonic)
    started: bool = False


class Lane:
    """Admission to the models' lane. `visitor_of(session_hash)` is the server's visitor of a session;
    `pending(session_hash)` says whether Gradio's queue still holds an event of it."""

    def __init__(self, hosted: bool, visitor_of: Callable, pending: Callable[[str], bool] = lambda s: False):
        self.hosted = hosted
        self.visitor_of = visitor_of
        self.pending = pending
        self.lock = threading.Lock()

    def alive(self, a: Admission | None, session: str) -> bool:
        return a is not None and (a.started or time.monotonic() - a.at < GRACE or self.pending(session))

    def admit(self, request: gr.Request, *values):
        """Gradio's validator of every heavy event: runs as it joins the queue; refuses a second job at once."""
        session = getattr(request, "session_hash", None)
        if self.hosted and session:
            try:
                v = self.visitor_of(session)
            except UserError as e:  # the visitor table is full of work in progress
                raise gr.Error(str(e), duration=None) from None
            with self.lock:
                if self.alive(v.job, session):
                    raise gr.Error(BUSY, duration=None)
                v.job = Admission()
        return [gr.validate(True, "")] * len(values)

    def started(self, v) -> None:
        with self.lock:
            if v.job is None:
                v.job = Admission()
            v.job.started = True

    def ended(self, v) -> None:
        with self.lock:
            v.job = None
