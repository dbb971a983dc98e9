"""layerswap.analysis.suggest: the plan suggested from where the language expert's change dominates."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from layerswap import Checkpoint, UserError
from layerswap.analysis import Analysis, analyze


def layered_trio(root: Path, base_dir: Path, lang_layers: set[int], seed: int = 5) -> dict[str, Path]:
    """float32 experts: the language expert changes `lang_layers` strongly, the math expert the others."""
    base = load_file(base_dir / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    out = {"base": base_dir}
    for r in ("math", "lang"):
        t = {}
        for n, v in base.items():
            layer = int(n.split(".layers.")[1].split(".")[0]) if ".layers." in n else None
            strong = (layer in lang_layers) if r == "lang" else (layer is not None and layer not in lang_layers)
            scale = 0.05 if strong else 0.005
            t[n] = v + scale * v.std() * torch.randn(v.shape, generator=g)
        out[r] = Path(shutil.copytree(base_dir, root / r))
        save_file(t, out[r] / "model.safetensors", metadata={"format": "pt"})
    return out


def analysis_of(paths: dict[str, Path], ks=()) -> Analysis:
    c = {r: Checkpoint.open(paths[r]) for r in ("base", "math", "lang")}
    return analyze(c["base"], c["math"], c["lang"], ks=ks, cache=False)


def test_suggest_plan_follows_the_dominance_rule(trio, tmp_path):
    t = layered_trio(tmp_path, trio["base"], lang_layers={0, 1, 5})
    an = analysis_of(t, ks=(1.0,))
    s = an.suggest_plan()
    assert s.lang_dominant == [True, True, False, False, False, True]
    assert (s.plan.b, s.plan.u, s.plan.tb, s.plan.tu) == (2, 1, 1, 1)
    assert "b=2, u=1" in s.markdown() and "`LL···L`" in s.markdown()
    s2 = an.suggest_plan("topk", 1.0)
    assert s2.lang_dominant == s.lang_dominant
    with pytest.raises(UserError, match="relative, mean_abs or topk"):
        an.suggest_plan("cosine")
    # swapped blocks that leave a single math layer: no room for transition layers
    t2 = layered_trio(tmp_path / "wide", trio["base"], lang_layers={0, 1, 2, 4, 5})
    s3 = analysis_of(t2).suggest_plan()
    assert s3.lang_dominant == [True, True, True, False, True, True]
    assert (s3.plan.b, s3.plan.u, s3.plan.tb, s3.plan.tu) == (3, 2, 0, 0)
    # an expert identical to the base never dominates: nothing to swap, and the note says so
    t3 = dict(t2, lang=trio["base"])
    s4 = analysis_of(t3).suggest_plan()
    assert (s4.plan.b, s4.plan.u) == (0, 0) and "nothing to swap" in s4.note
    t4 = dict(t2, math=trio["base"])
    s5 = analysis_of(t4).suggest_plan()
    assert (s5.plan.b, s5.plan.u) == (5, 0) and "one layer is left to the math expert" in s5.note
    s5.plan.validate(6)
