"""Text from models, the Hub and visitors shown as text: escaped before Markdown and HTML.

    f"architecture: {text(arch)}"        # no link, image, tag, heading, autolink or formula can form
    f"strict: {code(answer)}"            # an inline code span that the content cannot close
    f"{block(answer)}"                   # a fenced block whose fence is longer than any backtick run inside

Config strings, tensor names, tokens, answers and questions reach other visitors' pages (a shared link opens
someone's models); Gradio renders Markdown with links and images, and an error dialog renders HTML.
"""

from __future__ import annotations

import html
import re

_SPECIAL = re.compile(r"([\\`\[\]<>&#$|])")  # what can start a link, image, tag, entity, code, heading, formula
_AUTOLINK = re.compile(r"(?i)(://|www\.|@)")  # GFM autolinks: scheme://, www., e-mail addresses


def text(s: object, limit: int = 2000) -> str:
    """`s` as literal Markdown text (at most `limit` characters, newlines kept as spaces)."""
    s = " ".join(str(s)[:limit].split())
    s = _SPECIAL.sub(r"\\\1", s)
    return _AUTOLINK.sub(lambda m: "\\" + m.group(1) if m.group(1) != "www." else "www\\.", s)


def _longest_run(s: str) -> int:
    return max((len(r) for r in re.findall(r"`+", s)), default=0)


def code(s: object, limit: int = 2000) -> str:
    """`s` as an inline code span: delimited by more backticks than any run inside it."""
    s = " ".join(str(s)[:limit].splitlines()) or " "
    tick = "`" * (_longest_run(s) + 1)
    pad = " " if s[0] in "` " or s[-1] in "` " else ""
    return f"{tick}{pad}{s}{pad}{tick}"


def block(s: object, info: str = "") -> str:
    """`s` as a fenced code block; its fence is longer than any backtick run in `s`, so nothing inside closes it."""
    s = str(s)
    fence = "`" * max(3, _longest_run(s) + 1)
    return f"{fence}{info}\n{s}\n{fence}"


def html_text(s: object) -> str:
    """`s` for an HTML context (an error dialog): tags and entities shown as typed."""
    return html.escape(str(s), quote=False)
