"""How the page's events reach the library and back.

`event(fn, visitors, policy)` makes a handler `fn(job, *values)` a Gradio event: Gradio fills in the
request, and the caller's `Visitor` comes from the server's session (`Shared.visitor`), never from an
argument, so two API clients never share an identity, a Stop flag, a folder or an export. The `Job`
gives the handler its visitor and a progress callback that ends the job once the visitor pressed Stop.
Values that arrive as many inputs but mean one thing (the plan controls) are read once, by `read`, into the
one argument the handler takes for them.

A library error (`UserError`) becomes a dialog with its fix; an unexpected one (out of memory, a
disk error) a readable dialog too, never a bare "Error". In hosted mode, server paths are removed
from messages and from the text an event returns.
"""

from __future__ import annotations

import functools
import inspect
import json
import threading
import time
import typing
from dataclasses import dataclass, field
from typing import Callable

import gradio as gr

from layerswap.core.errors import UserError
from layerswap.serving.hosting import Policy
from layerswap.core.markup import html_text
from layerswap.core.runtime import Progress
from layerswap.ui.lane import Lane, time_limit, timed_out
from layerswap.ui.session import Visitor

STOPPED = "Stopped. Nothing was changed; the models stay loaded."
# the library's messages name the CLI's flags; the page says its own controls instead (`page_words`)
PAGE_WORDS = {"pass --force to run it anyway": "tick Force (beside Load) to load them anyway",
              "(drop --adapter)": "(use Export merged model)",
              "(layerswap merge --adapter)": "(Export as PEFT adapter)"}
MODELS_CHANGED = ("The models changed: the server no longer holds the models this page shows for you (or never "
                  "did). Press Load again.")


def page_words(message: str) -> str:
    """A library message as the page says it: the CLI flags it names become the page's controls (`PAGE_WORDS`)."""
    for cli, page in PAGE_WORDS.items():
        message = message.replace(cli, page)
    return message


def page_models(refs: tuple[str, str, str]) -> str:
    """The models a page shows, as the page sends them back with each event (`check_models`)."""
    return json.dumps(list(refs))


def check_models(shown: object, refs: tuple[str, str, str]) -> None:
    """Refuse a job whose page shows other models than the visitor's (its visitor was dropped and made
    again, say): it must never run on other models. Empty: an API caller that did not say."""
    if shown in (None, ""):
        return
    try:
        same = isinstance(shown, str) and len(shown) < 2000 and json.loads(shown) == list(refs)
    except ValueError:
        same = False
    if not same:
        raise UserError(MODELS_CHANGED)


@dataclass
class Job:
    """One event's caller and progress: `progress(fraction, text)` moves the page's bar and raises
    `UserError` once the visitor pressed Stop (the library's callbacks take it as it is)."""

    visitor: Visitor
    bar: Callable
    request: gr.Request | None = None
    started: float = field(default_factory=time.perf_counter)
    kind: str = ""
    timed_out: bool = False  # hosted mode: the kind's time limit passed (the visitor's Stop flag was set)

    def progress(self, fraction: float, desc: str = "") -> None:
        if self.visitor.stop.is_set():
            raise UserError(timed_out(self.kind) if self.timed_out else STOPPED)
        self.bar(fraction, desc=desc + self.time_left(fraction))

    def time_left(self, fraction: float) -> str:
        """`` · about N s left`` once the job is far enough along to say."""
        if fraction < 0.05:
            return ""
        left = (time.perf_counter() - self.started) * (1 - fraction) / fraction
        return f" · about {left:.0f} s left" if left < 120 else f" · about {left / 60:.0f} min left"

    def part(self, start: float, end: float) -> Progress:
        """Progress for one stage of the job, mapped to [start, end] of the bar."""
        return lambda f, d: self.progress(start + (end - start) * f, d)


def event(fn: Callable, visitor_of: Callable[[str | None], Visitor], policy: Policy | None = None, *,
          clear_stop: bool = True, rest: tuple[str, ...] = (), read: Callable[[tuple], object] = tuple,
          lane: Lane | None = None, release: Callable[[Visitor], None] | None = None,
          models: bool | str = False) -> Callable:
    """A Gradio handler for `fn(job, *values)`: the visitor of the request's session (a fresh one for a caller
    without a session), its Stop flag cleared first unless `clear_stop` is False (the Stop buttons), errors
    made readable (`guarded`). With a `lane` the job is heavy: it holds the visitor's one admission while it
    runs and, in hosted mode, stops at its kind's time limit (`ui.lane`); `release` runs after every job (the
    visitor table drops a visitor whose tab closed meanwhile). `models`: the event's last input is the models the
    page shows (`page_models`), refused unless they are the visitor's (`check_models`; ``"redraw"``: a chained
    redraw that a Load overtook is dropped without a dialog). The handler
    keeps `fn`'s parameter names, so the API's argument names and order are `fn`'s; `rest` names the values
    that `fn`'s last parameter stands for (the plan controls), so API clients see those names too, and `read`
    makes that one argument of them, once per event (`controls.read_plan`: the event's `Recipe`)."""
    pos = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = list(inspect.signature(fn).parameters.values())[1:]
    if rest:
        taken = {q.name for q in params[:-1]}
        params = params[:-1] + [inspect.Parameter(f"plan_{n}" if n in taken else n, pos) for n in rest]
    if models:
        params.append(inspect.Parameter("page_models", pos, default="", annotation=str))
    hints = typing.get_type_hints(getattr(fn, "func", fn))  # a functools.partial: its function's
    kind = getattr(getattr(fn, "func", fn), "__name__", "job")
    policy = policy or Policy()

    def start(request: gr.Request | None, progress, values: tuple) -> tuple[Job, threading.Timer | None, tuple]:
        v = visitor_of(getattr(request, "session_hash", None))
        if models:
            *values, shown = values or ("",)
            try:
                check_models(shown, v.refs)
            except UserError:
                if lane is not None:
                    lane.ended(v)  # its admission goes with it
                if models == "redraw":  # stale, not the visitor's doing: the chain stops, no dialog
                    raise gr.Error(MODELS_CHANGED, visible=False) from None
                raise
        if clear_stop:
            v.stop.clear()
        v.busy += 1
        job, timer = Job(v, progress, request, kind=kind), None
        if lane is not None:
            lane.started(v)
            if policy.hosted:
                def expire() -> None:
                    job.timed_out = True
                    v.stop.set()
                timer = threading.Timer(time_limit(kind), expire)
                timer.daemon = True
                timer.start()
        return job, timer, tuple(values)

    def args(values: tuple) -> tuple:
        """`fn`'s arguments: the values, the last `len(rest)` of them read into one (`read`)."""
        if not rest:
            return values
        cut = max(0, len(values) - len(rest))
        return (*values[:cut], read(values[cut:]))

    def end(job: Job, timer: threading.Timer | None) -> None:
        if timer is not None:
            timer.cancel()
        if lane is not None:
            lane.ended(job.visitor)
        job.visitor.busy -= 1
        if release is not None:
            release(job.visitor)  # its tab closed while this ran: the visitor goes now

    if inspect.isgeneratorfunction(fn):
        def handler(request: gr.Request, progress=gr.Progress(), *values):
            job, timer, values = start(request, progress, values)
            try:
                yield from fn(job, *args(values))
            finally:
                end(job, timer)
    else:
        def handler(request: gr.Request, progress=gr.Progress(), *values):
            job, timer, values = start(request, progress, values)
            try:
                return fn(job, *args(values))
            finally:
                end(job, timer)

    # what Gradio reads: request and progress first (it fills them in), then `fn`'s own parameters (some
    # without defaults after progress's, which only a signature built without validation can say)
    handler.__signature__ = inspect.Signature(
        [inspect.Parameter("request", pos, annotation=gr.Request), inspect.Parameter("progress", pos, default=gr.Progress()),
         *(q.replace(annotation=hints.get(q.name, q.annotation)) for q in params)], __validate_parameters__=False)
    handler.__annotations__ = {"request": gr.Request, **{q.name: hints[q.name] for q in params if q.name in hints}}
    handler.__name__ = handler.__qualname__ = getattr(getattr(fn, "func", fn), "__name__", "handler")
    handler.layerswap_event = True  # tests/test_hostile_inputs.py: every API event resolves its caller so
    return guarded(handler, policy)


def _message(e: BaseException) -> str:
    if isinstance(e, UserError):
        return page_words(str(e))
    if isinstance(e, MemoryError) or "out of memory" in str(e).lower():
        return ("Out of memory: the job was stopped and the models stay as they were. Try smaller models, fewer "
                "questions, or the one-engine serving mode.")
    if isinstance(e, OSError):
        return f"A file operation failed ({e.strerror or e}); nothing else changed."
    return f"Unexpected error ({type(e).__name__}: {e}); the models stay loaded. Please report it."


def _scrub_out(policy: Policy, out):
    if not policy.hosted:
        return out
    if isinstance(out, (list, tuple)):
        return type(out)(policy.scrub(x) if isinstance(x, str) else x for x in out)
    return policy.scrub(out) if isinstance(out, str) else out


def guarded(fn, policy: Policy | None = None):
    """Errors become gr.Error dialogs (scrubbed of server paths in hosted mode); generators too."""
    policy = policy or Policy()

    def fail(e: BaseException):  # the dialog renders HTML: a message quoting a model's files stays text
        raise gr.Error(html_text(policy.scrub(_message(e))), duration=None) from None

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen(*args, **kwargs):
            try:
                for out in fn(*args, **kwargs):
                    yield _scrub_out(policy, out)
            except gr.Error:
                raise
            except Exception as e:
                fail(e)
        return gen

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return _scrub_out(policy, fn(*args, **kwargs))
        except gr.Error:
            raise
        except Exception as e:
            fail(e)

    return wrapper
