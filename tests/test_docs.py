"""The README stays an index and the reference in docs/ stays true: links resolve, commands exist, the layer
tiers and the field table match the code."""

from __future__ import annotations

import re
import unicodedata

import pytest

from layerswap.cli import build_parser
from layerswap.recipe.fields import FIELDS
from tests.helpers import REPO
from tests.test_structure import PKG, _module, tiers, unit

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 220
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console", "text"}

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.S | re.M)


def _prose(text: str) -> str:
    """`text` without its fenced code blocks (a link inside code is not a link)."""
    return _FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = heading.strip().lower()
    h = "".join(c for c in h if c in " -_" or unicodedata.category(c)[0] in "LN")
    return h.replace(" ", "-")


def _anchors(path) -> set[str]:
    heads = re.findall(r"^#{1,6}\s+(.*?)\s*#*$", _prose(path.read_text()), re.M)
    return {_slug(re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", h)) for h in heads}


def test_readme_is_an_index():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move reference material into docs/ (at most {MAX_README_LINES})"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"


def _subcommands() -> set[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return set(sub.choices)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_in_code_blocks_exist(page):
    known = _subcommands()
    named = set()
    for lang, body in _FENCE.findall(page.read_text()):
        if lang in SHELL_BLOCKS:
            named |= set(re.findall(r"(?<![\w./-])layerswap\s+([a-z][\w-]*)", body))
    unknown = named - known
    assert not unknown, f"{page.relative_to(REPO)} names `layerswap {sorted(unknown)}`; subcommands are {sorted(known)}"


def test_architecture_tiers_list_every_module():
    """docs/architecture.md's tier table lists every top-level module once (`tests/test_structure.py` holds the
    imports to it: none goes up a tier)."""
    tier = tiers()
    units = {unit(_module(p)) for p in PKG.rglob("*.py")}
    assert units == set(tier), f"tier table vs package: missing {sorted(units - set(tier))}, " \
                               f"gone {sorted(set(tier) - units)}"


def test_field_table_matches_the_fields():
    text = (REPO / "docs" / "recipes.md").read_text()
    for f in FIELDS:
        row = f"| `{f.name}` | {f.kind} | `{f.flag}` | `{f.key}` |"
        assert row in text, f"docs/recipes.md's field table lacks or misstates {f.name}: expected a row {row}"
