"""`layerswap app`: the Gradio app (the same program as `python app.py`)."""

from __future__ import annotations

from layerswap.ui.launch import add_arguments


def add_parser(sub) -> None:
    s = sub.add_parser("app", help="the Gradio app (the same program as `python app.py`)")
    add_arguments(s)
    s.set_defaults(fn=run)


def run(args) -> int:
    from layerswap.ui import launch

    return launch.run(args)
