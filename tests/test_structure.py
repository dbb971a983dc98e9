"""The package stays one a newcomer can hold: small modules, and no import cycles (imports inside functions and
`TYPE_CHECKING` blocks count)."""

from __future__ import annotations

import ast
import re

from tests.helpers import REPO

PKG = REPO / "layerswap"


def _module(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path) -> set[str]:
    """layerswap modules imported anywhere in the file: at the top, inside functions and in `TYPE_CHECKING` blocks
    (an annotation's import is an arrow of the design too, and a deferred import a cycle all the same)."""
    tree = ast.parse(path.read_text())
    here = _module(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
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
    # importing a package runs its __init__, and with it the modules the __init__ imports (kept as arrows); a
    # module's import of its own package adds nothing (Python runs the package first anyway)
    for mod, deps in graph.items():
        graph[mod] = {d for d in deps if not mod.startswith(d + ".")}
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


def unit(module: str) -> str:
    """The top-level module or package of `layerswap` a module belongs to (its tier's unit)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "layerswap"


def tiers() -> dict[str, int]:
    """docs/architecture.md's tier table: each top-level module or package, and its tier."""
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*([\w, ]+?)\s*\|$", (REPO / "docs" / "architecture.md").read_text(), re.M)
    assert rows, "docs/architecture.md lost its tier table"
    tier: dict[str, int] = {}
    for t, names in rows:
        for name in (n.strip() for n in names.split(",")):
            assert name not in tier, f"{name} is in two tiers"
            tier[name] = int(t)
    return tier


def test_the_top_level_stays_small():
    """The library reads as a stack of folders: at most 13 packages at the top, and no loose module beside them."""
    top = {p.name for p in PKG.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert top - {"__init__.py"} <= {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}, \
        f"modules loose at the top of layerswap/: {sorted(n for n in top if n.endswith('.py') and n != '__init__.py')}"
    assert len(top) - 1 <= 13, f"{len(top) - 1} packages at the top of layerswap/: group them"


def test_no_import_goes_up_a_tier():
    """No module imports one of a higher tier of docs/architecture.md (`engines/` never imports merging, say)."""
    tier = tiers()
    upward = sorted({f"{_module(p)} -> {m}" for p in PKG.rglob("*.py") for m in _imports(p)
                     if unit(m) in tier and unit(_module(p)) in tier and tier[unit(m)] > tier[unit(_module(p))]})
    assert not upward, f"imports that go up a tier of docs/architecture.md: {upward}"


SCRIPTS = PKG.parent / "scripts"
ORGANISM_SCRIPTS = ("build_demo_experts.py", "build_demo2.py", "demo_ablation.py", "demo_measure.py", "eval_demo.py",
                    "demo_card.py", "demo2_card.py", "organism_card.py", "build_demo3.py", "demo_world3.py")


def _script_imports(path) -> set[str]:
    """Sibling scripts a script imports, anywhere in the file."""
    names = {p.stem for p in SCRIPTS.glob("*.py")}
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module in names:
            out.add(node.module)
    return out


def test_scripts_import_no_cycle():
    graph = {p.stem: _script_imports(p) - {p.stem} for p in SCRIPTS.glob("*.py")}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, "import cycle among scripts: " + " -> ".join(stack[stack.index(d):] + [m, d])
            if d not in state:
                visit(d, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_organism_scripts_have_no_second_planner():
    """The organism scripts classify tensors, revert and swap through the library (sources, plans, merging) and read
    results.json only through layerswap.shipped.results: no tensor-name parsing, no copy loop over parameters, no
    results.json layout of their own."""
    for name in ORGANISM_SCRIPTS:
        src = (SCRIPTS / name).read_text()
        tree = ast.parse(src)
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert not defined & {"layer_of", "in_range", "classify"}, (name, defined & {"layer_of", "in_range"})
        assert 'split(".")' not in src, name  # tensor names are classified by layerswap.models.architectures
        for key in ("paired_recommended_minus", "recommended_name", "target_language", "max_abs_weight_difference",
                    "dev_grid", "floors_target_language", "questions_per_language"):
            key = f'"{key}"'
            assert key not in src, (name, key)  # results.json's keys belong to layerswap.shipped.results
        assert ".copy_(" not in src or name == "eval_demo.py", name  # eval_demo: the dictionary baseline's rows
    build = (SCRIPTS / "build_demo_experts.py").read_text()
    assert "from layerswap.recipe.sources import Sources" in build and "merge_in_memory" in build
