"""The package stays one a newcomer can hold: small modules, and no import cycles (imports inside functions count)."""

from __future__ import annotations

import ast

from tests.helpers import REPO

PKG = REPO / "layerswap"


def _module(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path) -> set[str]:
    """layerswap modules imported anywhere in the file (top level, functions, TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(path.read_text())
    here = _module(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    out: set[str] = set()
    skip = set()
    for node in ast.walk(tree):  # annotations-only imports do not run
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + (node.module.split(".") if node.module else []))
            if not mod.startswith("layerswap"):
                continue
            for alias in node.names:  # `from . import mgsm` imports a module
                cand = f"{mod}.{alias.name}"
                out.add(cand if (PKG.parent / (cand.replace(".", "/") + ".py")).exists()
                        or (PKG.parent / cand.replace(".", "/")).is_dir() else mod)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("layerswap")}
    return out


def test_no_module_is_too_big():
    big = {str(p.relative_to(REPO)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not big, f"split these modules: {big}"


def test_every_module_says_what_it_holds():
    for p in PKG.rglob("*.py"):
        doc = ast.get_docstring(ast.parse(p.read_text()))
        assert doc and len(doc.split()) >= 4, f"{p.relative_to(REPO)} has no docstring saying what it holds"


def test_no_import_cycles():
    graph = {_module(p): {m for m in _imports(p) if m != _module(p)} for p in PKG.rglob("*.py")}
    # a package's __init__ re-exporting its own modules is not a cycle of the modules themselves
    for mod, deps in graph.items():
        graph[mod] = {d for d in deps if not (d.startswith(mod + ".") and PKG.joinpath(*mod.split(".")[1:]).is_dir())}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
