"""How the page's events reach the library and back.

A library error (`UserError`) becomes a dialog with its fix; an unexpected one (out of memory, a
disk error) a readable dialog too, never a bare "Error". In hosted mode, server paths are removed
from messages and from the text an event returns.
"""

from __future__ import annotations

import functools
import inspect

import gradio as gr

from ..errors import UserError
from ..hosting import Policy


def _message(e: BaseException) -> str:
    if isinstance(e, UserError):
        return str(e)
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

    def fail(e: BaseException):
        raise gr.Error(policy.scrub(_message(e)), duration=None) from None

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
