"""How the page's events reach the library and back: a library error becomes a dialog with its fix."""

from __future__ import annotations

import functools

import gradio as gr

from ..errors import UserError


def errors_as_gradio(fn):
    """User errors become gr.Error (shown as a modal with the fix); everything else propagates."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            raise gr.Error(str(e), duration=None) from None

    return wrapper
