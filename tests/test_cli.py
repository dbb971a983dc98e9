"""`layerswap inspect / diff / ask` as a user runs them."""

from __future__ import annotations

import csv
import re

import numpy as np
import pytest

from layerswap import Checkpoint, Plan
from layerswap.analysis import analyze
from layerswap.cli import main as cli
from layerswap.evaluation import mgsm
from tests.helpers import DEMO_MGSM, chromium_or_skip


def test_inspect_ok(trio, capsys):
    assert cli(["inspect", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "--base", str(trio["base"])]) == 0
    assert "compatible: LlamaForCausalLM, 6 layers" in capsys.readouterr().out


def test_diff_values_and_outputs(trio, tmp_path, capsys):
    c = {r: Checkpoint.open(trio[r]) for r in ("base", "math", "lang")}
    an = analyze(c["base"], c["math"], c["lang"], ks=(5.0,), cache=False)
    vals = an.values("math", "relative")
    grid = an.grid(vals)
    assert grid.shape == (9, 6) and an.row_labels[:3] == ["q", "k", "v"]
    # spot-check one cell against a direct computation
    import torch
    from safetensors.torch import load_file

    m, b = load_file(trio["math"] / "model.safetensors"), load_file(trio["base"] / "model.safetensors")
    name = "model.layers.3.mlp.up_proj.weight"
    direct = float(torch.linalg.norm(m[name] - b[name]) / torch.linalg.norm(b[name]))
    assert grid[an.ptypes.index("up_proj"), 3] == pytest.approx(direct, rel=1e-6)
    assert an.tensors[an.cell_index()[an.ptypes.index("up_proj"), 3]].name == name
    assert np.isfinite(vals[an.index("model.embed_tokens.weight")])

    models = ["--math", str(trio["math"]), "--lang", str(trio["lang"]), "--base", str(trio["base"])]
    cache = ["--cache-dir", str(tmp_path / "cache")]
    rc = cli(["diff", *models, "--b", "2", "--u", "1", "--tb", "1", "--tu", "0", "--metric", "topk", "--k", "5",
              "--k", "1", "--norm", "log", "-o", str(tmp_path / "h.html"),
              "--profile", str(tmp_path / "p.html"), "--csv", str(tmp_path / "h.csv"),
              "--top-csv", str(tmp_path / "top.csv"), "--top", "3", *cache])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Top-5% sets" in out and "per layer (bottom to top)" in out and "outside the layers" in out
    assert "the weight-diff prior: b=" in out and "plan overlay: b=2 u=1 tb=1 tu=0" in out
    html = (tmp_path / "h.html").read_text()
    assert "plotly" in html.lower() and name in html and "merged model vs base" in html
    assert "Change by depth" in (tmp_path / "p.html").read_text()
    # the CSV holds every metric of every tensor, equal to the Python API's numbers
    c = {r: Checkpoint.open(trio[r]) for r in ("base", "math", "lang")}
    an = analyze(c["base"], c["math"], c["lang"], ks=(5.0,), cache=False)
    merged = an.merged(Plan(b=2, u=1, tb=1, tu=0), c["math"], c["lang"], c["base"])
    rows = list(csv.DictReader(open(tmp_path / "h.csv")))
    assert len(rows) == 9 * 6 + 3
    want = {r["tensor"]: r for r in an.rows(5.0, merged)}
    for row in rows:
        for col in ("relative_math", "mean_abs_lang", "topk_share_lang", "topk_jaccard", "relative_merged",
                    "relative_merged_vs_math", "w_lang"):
            w = want[row["tensor"]][col]
            assert (row[col] == "" and w is None) or float(row[col]) == pytest.approx(w, rel=1e-12), (row["tensor"], col)
    top = list(csv.DictReader(open(tmp_path / "top.csv")))
    assert len(top) == 2 * len(an.tensors) and top[0]["tensor"] == an.most_changed(1, by="topk", k=5.0)[0]["tensor"]
    # the second run is served from the cache
    assert cli(["diff", *models, "--no-plan", "--k", "1", "-q", *cache]) == 0
    assert "Loaded from the cache" in capsys.readouterr().out
    assert cli(["diff", *models, "--no-plan", "--k", "2", "-q", "--workers", "2", "--csv", str(tmp_path / "w.csv"),
                *cache]) == 0
    assert "Computed in" in capsys.readouterr().out
    two = {r["tensor"]: r for r in csv.DictReader(open(tmp_path / "w.csv"))}
    for r in rows:
        assert two[r["tensor"]]["relative_math"] == r["relative_math"]


def test_diff_png(trio, tmp_path, capsys):
    """PNG export renders through kaleido, which drives Chromium."""
    chromium_or_skip()
    models = ["--math", str(trio["math"]), "--lang", str(trio["lang"]), "--base", str(trio["base"])]
    rc = cli(["diff", *models, "--no-cache", "-q", "-o", str(tmp_path / "h.png"), "--profile", str(tmp_path / "p.png")])
    assert rc == 0, capsys.readouterr().err
    for f in ("h.png", "p.png"):
        assert (tmp_path / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_diff_errors(trio, capsys):
    models = ["--math", str(trio["math"]), "--lang", str(trio["lang"]), "--base", str(trio["base"])]
    assert cli(["diff", *models, "--panels", "math,nonsense", "--no-cache"]) == 2
    assert "Unknown panel 'nonsense'" in capsys.readouterr().err
    assert cli(["diff", *models, "--b", "5", "--u", "2", "--no-cache"]) == 2
    assert "exceeds the model's 6 layers" in capsys.readouterr().err
    assert cli(["diff", *models, "--k", "0", "--no-cache"]) == 2
    assert "percentage" in capsys.readouterr().err


def test_ask_mgsm_side_by_side(trio, capsys):
    rc = cli(["ask", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "--b", "1", "--u", "1",
              "--mgsm-lang", "xx", "--index", "3", "--mgsm-dir", str(DEMO_MGSM), "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Sorvi:" in out and f"gold answer: {mgsm.load('xx', DEMO_MGSM)[3].answer}" in out
    for name in ("== math expert", "== language expert", "== merged model"):
        assert name in out
    assert out.count("flexible:") == 3


def test_ask_free_text(trio, capsys):
    rc = cli(["ask", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "--question", "What is 2 + 3?",
              "--max-new-tokens", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and "Question: What is 2 + 3?\n" in out.replace("  | ", "") and "gold answer" not in out


def test_ask_needs_a_question(trio, capsys):
    assert cli(["ask", "--math", str(trio["math"]), "--lang", str(trio["lang"])]) == 2
    assert "Give either --question" in capsys.readouterr().err


def test_every_command_shares_device_and_engine_options(capsys):
    """--device defaults to auto everywhere; ask takes the same engine options as eval and sweep."""
    from layerswap.cli import build_parser

    p = build_parser()
    models = ["--math", "m", "--lang", "l"]
    cases = {"merge": [*models, "-o", "x"], "diff": [*models, "--base", "b"], "ask": [*models], "eval": ["--model", "m"],
             "sweep": [*models], "app": []}
    for cmd, rest in cases.items():
        args = p.parse_args([cmd, *rest])
        assert args.device == "auto", cmd
    args = p.parse_args(["ask", *models, "--engine", "vllm", "--serving", "one", "--max-model-len", "512"])
    assert (args.engine, args.serving, args.max_model_len) == ("vllm", "one", 512)
    for cmd in ("ask", "eval", "sweep", "app"):  # GPUs per vLLM engine, for experts too big for one
        rest = cases[cmd]
        assert p.parse_args([cmd, *rest, "--tensor-parallel-size", "2"]).tensor_parallel_size == 2, cmd


def test_tensor_parallel_reaches_the_vllm_engine(vllm_trio, capsys):
    """--tensor-parallel-size is handed to vLLM: on this CPU machine it is refused before an engine starts."""
    from tests.helpers import vllm_or_skip

    vllm_or_skip()
    assert cli(["ask", "--math", str(vllm_trio["math"]), "--lang", str(vllm_trio["lang"]), "--question", "2 + 2?",
                "--engine", "vllm", "--device", "cpu", "--tensor-parallel-size", "2"]) == 2
    assert "tensor_parallel_size 2 splits a model over 2 GPUs" in capsys.readouterr().err


def test_app_command_is_app_py(capsys):
    with pytest.raises(SystemExit) as e:
        cli(["app", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--math", "--lang", "--base", "--mgsm-dir", "--engine", "--serving", "--port", "--share"):
        assert flag in out


# ---- the first hour, round 3 (issue 41): what a command prints, where -----------------------------------------


def _table(stdout: str) -> list[list[str]]:
    """`stdout` read as one Markdown table, and nothing else (fails on any other line)."""
    rows = [[c.strip() for c in line.split("|")] for line in stdout.splitlines()]
    assert rows and all(len(r) == len(rows[0]) for r in rows), stdout
    assert set(rows[1]) == {"---"}, stdout
    return rows


def test_eval_stdout_is_only_the_table():
    """Issue 41, point 9: `layerswap eval ... > table.md` holds only the table; vLLM's log lines (its workers' and
    C++ prints included), the engine, plan and protocol lines go to stderr."""
    from tests.helpers import run_cli, vllm_or_skip

    vllm_or_skip()
    r = run_cli("eval", "--model", "assets:demo/math", "--engine", "vllm", "--limit", "2", "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _table(r.stdout)
    assert rows[0] == ["language", "n", "extraction", "math"]
    assert [(x[0], x[2]) for x in rows[2:]] == [(lang, m) for m in ("flexible", "strict")
                                               for lang in ("xx", "average", "max")]
    assert all(x[1] == "2" for x in rows[2:])
    assert re.search(r"(WARNING|INFO) .*\[\w+\.py:\d+\]", r.stderr), r.stderr[-2000:]  # vLLM logged, to stderr
    assert "engine: answered by vLLM" in r.stderr

    r = run_cli("eval", "--math", "assets:demo/math", "--lang", "assets:demo/lang", "--engine", "transformers",
                "--langs", "xx,en", "--limit", "1", "--max-new-tokens", "4", "-q")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _table(r.stdout)
    assert rows[0] == ["language", "n", "extraction", "math expert", "language expert", "merged model"]
    assert len(rows) == 2 + 2 * 4
    assert "plan: swap b=" in r.stderr and "engine: " in r.stderr


def test_eval_help_says_how_many_questions_the_shipped_sets_hold(capsys):
    """Issue 41, point 13: `--limit`'s default is what the sets hold (demo, demo2: 1,000; demo3: 500), read from the
    data."""
    from layerswap.models.presets import assets_dir

    with pytest.raises(SystemExit):
        cli(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    n = {len(mgsm.load(p.stem.removeprefix("mgsm_"), p.parent)) for p in assets_dir().glob("*/mgsm/mgsm_*.tsv")}
    assert n == {500, 1000} and "250" not in text
    assert "the shipped demo3 sets hold 500 per language; the shipped demo and demo2 sets hold 1,000 per language" \
        in text


def _readme_blocks() -> list[str]:
    """The README's shell blocks on shipped models (`assets:`), as written."""
    from tests.helpers import REPO

    text = (REPO / "README.md").read_text()
    return [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "assets:demo" in b and "layerswap" in b]


def test_the_readme_commands_run_on_the_shipped_demo_as_written(tmp_path):
    """Issue 41, point 14: the README's three-command block and its LoRA pair run as written (a `layerswap` on PATH,
    in a fresh folder); each writes what it says, the LoRA pair's `inspect` warns, exits 0 and names the organism's
    plan, and its merge is a LoRA adapter on that plan."""
    import json
    import os
    import subprocess
    import sys

    from tests.helpers import REPO

    blocks = _readme_blocks()
    assert len(blocks) == 2 and [len(b.strip().splitlines()) for b in blocks] == [3, 2], blocks
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "layerswap").write_text(f'#!/bin/sh\nexec {sys.executable} -m layerswap.cli "$@"\n')
    (bin_dir / "layerswap").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(REPO),
               LAYERSWAP_CACHE=str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    outs = []
    for block in blocks:
        for line in block.strip().splitlines():
            r = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, (line, r.stdout[-2000:], r.stderr[-2000:])
            outs.append(r.stdout)
    assert "plotly" in (work / "heatmap.html").read_text()[:100_000].lower()
    assert json.loads((work / "merged" / "layerswap.json").read_text())["recipe"]["plan"]["b"] == 2
    rows = _table((work / "table.md").read_text())
    assert rows[0] == ["language", "n", "extraction", "math expert", "language expert", "merged model"]
    assert rows[2][:3] == ["xx", "10", "flexible"]
    inspect = outs[3]
    assert inspect.startswith("compatible:") and "warning: the experts may not share a base" in inspect
    assert "opens on swap b=2 u=0 tb=0 tu=0" in inspect and "recommended for assets:demo (math + lang)" in inspect
    lora = work / "merged-lora"
    assert json.loads((lora / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert json.loads((lora / "layerswap.json").read_text())["recipe"]["plan"]["b"] == 2
