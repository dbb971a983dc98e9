"""mergekit interoperability: mergekit run on layerswap's YAML gives bit-identical tensors."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from layerswap import Checkpoint, MethodConfig, Plan, Recipe, UserError, export_merge
from layerswap.cli import main as cli
from layerswap.merge.interop import mergekit_config
from tests.helpers import read_dir

PLANS = {
    "paper-like": (Plan(b=2, u=1, tb=1, tu=1), None),
    "ramp": (Plan(b=1, u=1, tb=2, tu=2, transition="ramp"), None),
    "attention-only": (Plan(b=2, u=1, tb=1, tu=0, modules="attention"), None),
    "mlp-only-avg": (Plan(b=1, u=2, tb=0, tu=1, modules="mlp", non_layer="avg"), None),
    "middle": (Plan(kind="middle", k=2, non_layer="math"), None),
    "random": (Plan(kind="random", k=3, seed=4, non_layer="lang"), None),
    "alternating": (Plan(kind="alternating", offset=1), None),
    "weights": (Plan(kind="weights", weights=(0.3, 1 / 3, 0.9, 0.0, 1.0, 0.55)), None),
    "soup": (Plan(), MethodConfig("soup", weight=0.35)),
}


def _mergekit_bin() -> str:
    exe = Path(sys.executable).parent / "mergekit-yaml"
    if not exe.exists():
        if shutil.which("mergekit-yaml"):
            return shutil.which("mergekit-yaml")
        pytest.fail("mergekit is part of the test extra: pip install -e '.[test]'")
    return str(exe)


# mergekit-yaml's own entry point (the click command its console script calls), run once per config in ONE
# interpreter: mergekit's start-up (torch, transformers, ~5 s of CPU) is paid once, not once per config.
_RUN_MANY = """
import sys
from mergekit.scripts.run_yaml import main
for yml, out in zip(sys.argv[1::2], sys.argv[2::2]):
    main([yml, out, "--copy-tokenizer", "--quiet"], standalone_mode=False)
"""


def run_mergekit(pairs: list[tuple[Path, Path]]) -> None:
    """mergekit-yaml CONFIG OUT for each pair (fails with mergekit's error if any run fails)."""
    _mergekit_bin()  # mergekit is installed (the test extra)
    args = [str(a) for pair in pairs for a in pair]
    r = subprocess.run([sys.executable, "-c", _RUN_MANY, *args],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.fixture(scope="module")
def merged_both_ways(trio_bf16, tmp_path_factory) -> dict[str, tuple[int, Path]]:
    """For each plan: layerswap's export-yaml (exit code, folder with merge.yml), layerswap's export (ours) and
    mergekit's run of that YAML (theirs), mergekit run once over every plan."""
    math, lang = Checkpoint.open(trio_bf16["math"]), Checkpoint.open(trio_bf16["lang"])
    done = {}
    for key, (plan, method) in PLANS.items():
        d = tmp_path_factory.mktemp(f"interop-{key}")
        rc = cli(["export-yaml", "--math", str(trio_bf16["math"]), "--lang", str(trio_bf16["lang"]),
                  *_plan_flags(plan, method), "-o", str(d / "merge.yml")])
        export_merge(math, lang, Recipe(method) if method else Recipe(plan=plan), d / "ours")
        done[key] = (rc, d)
    run_mergekit([(d / "merge.yml", d / "theirs") for rc, d in done.values() if rc == 0])
    return done


@pytest.mark.parametrize("key", list(PLANS))
def test_mergekit_reproduces_layerswap_bit_for_bit(trio_bf16, merged_both_ways, key):
    plan, method = PLANS[key]
    math, lang = Checkpoint.open(trio_bf16["math"]), Checkpoint.open(trio_bf16["lang"])
    rc, d = merged_both_ways[key]
    assert rc == 0
    recipe = Recipe(method) if method else Recipe(plan=plan)
    assert yaml.safe_load((d / "merge.yml").read_text()) == mergekit_config(math, lang, recipe)
    assert_same_tensors(d)


def _plan_flags(plan: Plan, method: MethodConfig | None) -> list[str]:
    f = ["--b", str(plan.b), "--u", str(plan.u), "--tb", str(plan.tb), "--tu", str(plan.tu),
         "--transition", plan.transition, "--transition-weight", str(plan.transition_weight),
         "--non-layer", plan.non_layer, "--map", plan.kind, "--map-k", str(plan.k), "--seed", str(plan.seed),
         "--offset", str(plan.offset), "--modules", plan.modules]
    if plan.weights is not None:
        f += ["--layer-weights", ",".join(repr(w) for w in plan.weights)]
    if method is not None:
        f += ["--method", method.name, "--weight", str(method.weight)]
    return f


def test_yaml_refuses_methods_without_a_linear_equivalent(trio):
    math, lang = Checkpoint.open(trio["math"]), Checkpoint.open(trio["lang"])
    with pytest.raises(UserError, match="does not claim a mergekit equivalent"):
        mergekit_config(math, lang, Recipe(MethodConfig("ties")))


def test_yaml_shape(trio):
    cfg = mergekit_config(Checkpoint.open(trio["math"]), Checkpoint.open(trio["lang"]), Plan(b=2, u=1, tb=1, tu=1))
    ranges = [s["sources"][0]["layer_range"] for s in cfg["slices"]]
    assert ranges == [[0, 0], [0, 2], [2, 3], [3, 4], [4, 5], [5, 6], [6, 6]]
    assert cfg["merge_method"] == "linear" and cfg["parameters"] == {"normalize": False}
    assert [len(s["sources"]) for s in cfg["slices"]] == [2, 1, 2, 1, 2, 1, 2]


def test_reverted_layers_come_from_the_base_in_mergekit(trio_bf16, tmp_path, capsys):
    math, lang, base = (Checkpoint.open(trio_bf16[r]) for r in ("math", "lang", "base"))
    plan = Plan(b=2, u=1, tb=1, tu=0, revert=(2, 3))
    common = ["export-yaml", "--math", str(trio_bf16["math"]), "--lang", str(trio_bf16["lang"]), "--b", "2", "--u", "1",
              "--tb", "1", "--tu", "0", "--revert", "2-3"]
    assert cli(common + ["-o", str(tmp_path / "x.yml")]) == 2
    assert "reverts layers 2-3 to the base model" in capsys.readouterr().err
    yml = tmp_path / "merge.yml"
    assert cli(common + ["--base", str(trio_bf16["base"]), "-o", str(yml)]) == 0
    cfg = yaml.safe_load(yml.read_text())
    assert cfg == mergekit_config(math, lang, plan, base)
    base_slices = [s for s in cfg["slices"] if s["sources"][0]["model"] == str(base.path)]
    assert [s["sources"][0]["layer_range"] for s in base_slices] == [[2, 4]]
    export_merge(math, lang, plan, tmp_path / "ours", base=base)
    assert_mergekit_rebuilds(yml, tmp_path)


def assert_mergekit_rebuilds(yml, tmp_path) -> None:
    """mergekit-yaml on `yml` writes tmp_path/theirs bit-identical to our export in tmp_path/ours."""
    r = subprocess.run([_mergekit_bin(), str(yml), str(tmp_path / "theirs"), "--copy-tokenizer", "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_tensors(tmp_path)


def assert_same_tensors(folder: Path) -> None:
    """folder/ours and folder/theirs hold the same tensor names, dtypes, shapes and bits."""
    ours, theirs = read_dir(folder / "ours"), read_dir(folder / "theirs")
    assert set(ours) == set(theirs)
    for name in ours:
        a, b = ours[name], theirs[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name} differs"
