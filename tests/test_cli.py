"""`layerswap inspect / diff / ask` as a user runs them."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from layerswap import Checkpoint
from layerswap.analysis import diff_vs_base, relative_change
from layerswap.cli import main as cli


def test_inspect_ok(trio, capsys):
    assert cli(["inspect", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "--base", str(trio["base"])]) == 0
    assert "compatible: LlamaForCausalLM, 6 layers" in capsys.readouterr().out


def test_diff_values_and_outputs(trio, tmp_path, capsys):
    d = diff_vs_base(Checkpoint.open(trio["math"]), Checkpoint.open(trio["base"]))
    assert d.values.shape == (9, 6) and d.row_labels[:3] == ["q", "k", "v"]
    # spot-check one cell against a direct computation
    import torch
    from safetensors.torch import load_file

    m, b = load_file(trio["math"] / "model.safetensors"), load_file(trio["base"] / "model.safetensors")
    name = "model.layers.3.mlp.up_proj.weight"
    direct = float(torch.linalg.norm(m[name] - b[name]) / torch.linalg.norm(b[name]))
    assert d.values[d.ptypes.index("up_proj"), 3] == pytest.approx(direct, rel=1e-6)
    assert d.names[d.ptypes.index("up_proj")][3] == name
    assert relative_change(b[name], b[name]) == 0.0
    assert np.isfinite(d.non_layer["model.embed_tokens.weight"])

    rc = cli(["diff", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "--base", str(trio["base"]),
              "-o", str(tmp_path / "h.html"), "-o", str(tmp_path / "h.png"), "--csv", str(tmp_path / "h.csv")])
    assert rc == 0
    html = (tmp_path / "h.html").read_text()
    assert "plotly" in html.lower() and name in html
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(open(tmp_path / "h.csv")))
    assert len(rows) == 2 * (9 * 6 + 3)
    assert "mean relative change per layer" in capsys.readouterr().out


def test_ask_mgsm_side_by_side(trio, mgsm_dir, capsys):
    rc = cli(["ask", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "--b", "1", "--u", "1",
              "--mgsm-lang", "sw", "--index", "3", "--mgsm-dir", str(mgsm_dir), "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Swali:" in out and "gold answer: 540" in out
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
