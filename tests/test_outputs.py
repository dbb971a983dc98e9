"""Outputs never replace, contain or sit inside an input; --overwrite replaces only earlier exports."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from layerswap.models.checkpoints import Checkpoint
from layerswap.core.errors import UserError
from layerswap.merge.merging import export_merge
from layerswap.merge.outputs import check_output_file, check_output_folder, input_paths
from layerswap.recipe.plans import Plan

from .helpers import cli_in_process, run_cli


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` with a hash of its bytes (what 'nothing touched' compares)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture()
def copies(trio, tmp_path) -> dict[str, Path]:
    """Copies of the experts in dl/sub/{math,lang,base} (the shapes of the reported cases)."""
    root = tmp_path / "dl" / "sub"
    out = {}
    for role in ("math", "lang", "base"):
        out[role] = root / role
        shutil.copytree(trio[role], out[role])
    return out


def merge(c, out, *extra, run=run_cli):
    return run("merge", "--math", str(c["math"]), "--lang", str(c["lang"]), "--base", str(c["base"]),
                   "--b", "1", "--u", "1", "--tb", "0", "--tu", "0", "-o", str(out), *extra)


@pytest.mark.parametrize("where, word", [
    (lambda c: c["math"], "is an input"),                      # onto the math expert
    (lambda c: c["math"].parent, "contains an input"),         # the folder above both experts
    (lambda c: c["math"].parent.parent, "contains an input"),  # two folders above
    (lambda c: c["lang"] / "merged", "is inside an input"),    # inside the language expert
    (lambda c: c["base"], "is an input"),                      # onto the base
])
def test_cli_refuses_outputs_touching_inputs(copies, tmp_path, where, word):
    """In process (the CLI's main; the other tests here run it as a user does, in a fresh process)."""
    before = snapshot(tmp_path)
    r = merge(copies, where(copies), "--overwrite", run=cli_in_process)
    assert r.returncode == 2 and word in r.stderr and "nothing was written" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert snapshot(tmp_path) == before


def test_overwrite_replaces_only_an_earlier_export(copies, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    before = snapshot(tmp_path)
    r = merge(copies, foreign, "--overwrite")
    assert r.returncode == 2 and "not an earlier layerswap export" in r.stderr
    assert snapshot(tmp_path) == before
    out = tmp_path / "exports" / "m"
    assert merge(copies, out).returncode == 0
    first = snapshot(out)
    r = merge(copies, out)
    assert r.returncode == 2 and "already exists" in r.stderr
    assert merge(copies, out, "--overwrite").returncode == 0
    assert snapshot(out).keys() == first.keys()


def test_symlinked_output_into_an_input_is_refused(copies, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(copies["math"], target_is_directory=True)
    before = snapshot(copies["math"].parent)
    r = merge(copies, link / "new", "--overwrite")
    assert r.returncode == 2 and "is inside an input" in r.stderr
    assert snapshot(copies["math"].parent) == before


def test_cli_file_outputs_are_checked(copies, tmp_path):
    c = copies
    cfg = c["math"] / "config.json"
    before = snapshot(tmp_path)
    r = run_cli("export-yaml", "--math", str(c["math"]), "--lang", str(c["lang"]), "-o", str(cfg))
    assert r.returncode == 2 and "is inside an input" in r.stderr
    r = run_cli("diff", "--math", str(c["math"]), "--lang", str(c["lang"]), "--base", str(c["base"]),
                "--csv", str(c["base"] / "metrics.csv"), "-q")
    assert r.returncode == 2 and "is inside an input" in r.stderr
    assert snapshot(tmp_path) == before


def test_library_rules(copies, tmp_path):
    m, lang, base = (Checkpoint.open(copies[r]) for r in ("math", "lang", "base"))
    inputs = input_paths(m, lang, base, extra=["not/a/local/path", tmp_path / "missing"])
    assert inputs == [copies["math"].resolve(), copies["lang"].resolve(), copies["base"].resolve()]
    with pytest.raises(UserError, match="contains an input"):
        export_merge(m, lang, Plan(b=1, u=1), copies["math"].parent, base=base, overwrite=True)
    with pytest.raises(UserError, match="is inside an input"):
        check_output_file(copies["base"] / "x.png", inputs)
    with pytest.raises(UserError, match="contains an input"):
        check_output_folder(tmp_path, inputs, overwrite=True)
    protected = tmp_path / "mgsm"
    protected.mkdir()
    with pytest.raises(UserError, match="is inside an input"):
        export_merge(m, lang, Plan(b=1, u=1), protected / "out", base=base, protect=(protected,))
    assert not (protected / "out").exists()


def test_a_file_that_appears_at_the_output_during_a_merge_is_kept(tmp_path):
    from layerswap.merge.merging import _atomic_replace

    tmp, out = tmp_path / ".merge-tmp", tmp_path / "out"
    tmp.mkdir()
    out.write_text("the user's file")
    with pytest.raises(UserError, match="appeared while merging"):
        _atomic_replace(tmp, out, overwrite=True)
    assert out.read_text() == "the user's file" and tmp.is_dir()
