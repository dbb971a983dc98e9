"""Merged tensors equal what the plan says, exactly, through the Python API and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from layerswap import Checkpoint, Plan, export_merge
from layerswap.cli import main as cli
from tests.helpers import (assert_matches_plan, assert_nothing_written, expected_layer_weights, expected_tensor,
                           expected_weight, read_dir,
                           run_cli)

PLANS = {
    "none": Plan(b=0, u=0, tb=0, tu=0),
    "hard-swap": Plan(b=2, u=1, tb=0, tu=0),
    "default-1-1": Plan(b=1, u=1, tb=1, tu=1),
    "wide-ramp": Plan(b=1, u=1, tb=2, tu=2, transition="ramp"),
    "flat-0.3": Plan(b=1, u=1, tb=2, tu=1, transition="flat", transition_weight=0.3),
    "full": Plan(b=2, u=2, tb=1, tu=1),  # b+tb+tu+u = L
    "all-lang": Plan(b=6, u=0, tb=0, tu=0),
    "nl-math": Plan(b=2, u=1, tb=1, tu=1, non_layer="math"),
    "nl-lang": Plan(b=0, u=0, tb=1, tu=0, non_layer="lang"),
    "nl-avg": Plan(b=2, u=1, tb=1, tu=1, non_layer="avg"),
    "nl-neighbour-ramp": Plan(b=0, u=0, tb=2, tu=3, transition="ramp"),
}


@pytest.mark.parametrize("key", list(PLANS))
def test_api_merge_matches_plan(trio, tmp_path, key):
    plan = PLANS[key]
    math, lang = Checkpoint.open(trio["math"]), Checkpoint.open(trio["lang"])
    s = export_merge(math, lang, plan, tmp_path / "out")
    assert s.layer_weights == expected_layer_weights(plan, 6)
    assert_matches_plan(tmp_path / "out", trio, plan)


@pytest.mark.parametrize("key", ["default-1-1", "wide-ramp", "nl-avg"])
def test_bf16_merge_matches_plan(trio_bf16, tmp_path, key):
    plan = PLANS[key]
    export_merge(Checkpoint.open(trio_bf16["math"]), Checkpoint.open(trio_bf16["lang"]), plan, tmp_path / "o")
    assert_matches_plan(tmp_path / "o", trio_bf16, plan)


def test_blends_in_any_steps_are_the_same_bits(trio_bf16, tmp_path, monkeypatch):
    """On CPU a blend runs in steps of CPU_STEP inside reads of CHUNK_ELEMS: where they fall changes no bit."""
    import layerswap.merge.merging as merging

    monkeypatch.setattr(merging, "CHUNK_ELEMS", 3001)
    monkeypatch.setattr(merging, "CPU_STEP", 1000)
    plan = PLANS["wide-ramp"]
    export_merge(Checkpoint.open(trio_bf16["math"]), Checkpoint.open(trio_bf16["lang"]), plan, tmp_path / "o")
    assert_matches_plan(tmp_path / "o", trio_bf16, plan)


def _cli_args(plan: Plan) -> list[str]:
    return ["--b", str(plan.b), "--u", str(plan.u), "--tb", str(plan.tb), "--tu", str(plan.tu),
            "--transition", plan.transition, "--transition-weight", str(plan.transition_weight),
            "--non-layer", plan.non_layer]


@pytest.mark.parametrize("key", ["none", "hard-swap", "wide-ramp", "flat-0.3", "full", "nl-math", "nl-lang", "nl-avg"])
def test_cli_merge_matches_plan(trio, tmp_path, key, capsys):
    plan = PLANS[key]
    rc = cli(["merge", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "--base", str(trio["base"]),
              *_cli_args(plan), "-o", str(tmp_path / "out"), "--out-shard-size", "60KB"])
    assert rc == 0
    out = tmp_path / "out"
    assert (out / "model.safetensors.index.json").exists()  # several shards at 60 KB
    assert_matches_plan(out, trio, plan)
    assert "wrote" in capsys.readouterr().out


def test_export_is_a_loadable_hf_model_with_card(trio, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plan = PLANS["default-1-1"]
    export_merge(Checkpoint.open(trio["math"]), Checkpoint.open(trio["lang"]), plan, tmp_path / "m",
                 shard_bytes=100_000)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert model.config.num_hidden_layers == 6 and len(tok) == model.config.vocab_size
    card = (tmp_path / "m" / "README.md").read_text()
    assert "swap b=1 u=1 tb=1 tu=1" in card and "`math` (local folder)" in card and "`lang` (local folder)" in card
    assert str(trio["math"].parent) not in card  # no path of the merging machine (field checks: test_card.py)
    prov = json.loads((tmp_path / "m" / "layerswap.json").read_text())
    assert prov["layer_weights_lang"] == expected_layer_weights(plan, 6)
    # the merged model generates like the exported tensors say
    sd = read_dir(tmp_path / "m")
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]), k


def test_in_memory_merge_equals_export_and_shares_tensors(trio, tmp_path):
    from layerswap.serving.workbench import Workbench

    plan = PLANS["wide-ramp"]
    wb = Workbench()
    wb.load(str(trio["math"]), str(trio["lang"]))
    wb.build(plan)
    merged = wb.engines["merged"].model.state_dict()
    math_sd, lang_sd = wb.engines["math"].model.state_dict(), wb.engines["lang"].model.state_dict()
    export_merge(Checkpoint.open(trio["math"]), Checkpoint.open(trio["lang"]), plan, tmp_path / "o")
    on_disk = read_dir(tmp_path / "o")
    for k, v in merged.items():
        assert torch.equal(v, on_disk[k]), k
        w = expected_weight(k, plan, 6)
        if w == 0.0:
            assert v.data_ptr() == math_sd[k].data_ptr()  # shared, not copied
        elif w == 1.0:
            assert v.data_ptr() == lang_sd[k].data_ptr()
    # re-merging with another plan refreshes the same engine in place
    eng = wb.engines["merged"]
    wb.build(PLANS["none"])
    assert wb.engines["merged"] is eng
    for k, v in eng.model.state_dict().items():
        assert torch.equal(v, math_sd[k])


def test_merge_stream_equals_export_and_writes_nothing(trio, tmp_path):
    """The stream a running vLLM engine is refreshed from (refresh ``memory``) holds the export's tensors, bit for
    bit, for a layer plan, a reverted range and a merge method; it is checked as the export is, and writes nothing."""
    from layerswap import Recipe, UserError
    from layerswap.merge.merging import merge_stream
    from layerswap.recipe.methods import MethodConfig

    cks = {r: Checkpoint.open(trio[r]) for r in ("math", "lang", "base")}
    for i, recipe in enumerate([PLANS["wide-ramp"], Plan(b=1, u=1, tb=1, tu=0, revert=(3, 4)),
                                Recipe(method=MethodConfig("ties", density=0.5))]):
        before = sorted(tmp_path.rglob("*"))
        stream = merge_stream(cks["math"], cks["lang"], recipe, base=cks["base"])
        got = dict(stream())
        assert sorted(tmp_path.rglob("*")) == before
        export_merge(cks["math"], cks["lang"], recipe, tmp_path / f"o{i}", base=cks["base"])
        on_disk = read_dir(tmp_path / f"o{i}")
        assert list(got) == list(cks["math"].tensors) and got.keys() == on_disk.keys()
        assert all(torch.equal(v, on_disk[k]) for k, v in got.items()), recipe
        assert [n for n, _ in stream()] == list(got)  # a swapped engine streams it again at each switch
    with pytest.raises(UserError, match="base"):
        merge_stream(cks["math"], cks["lang"], Recipe(method=MethodConfig("ties", density=0.5)))


def test_tied_embeddings_and_biases(tmp_path, tokenizer):
    """Qwen2-style: q/k/v biases and tied embeddings (no lm_head tensor)."""
    from tests.helpers import make_trio

    t = make_trio(tmp_path / "q", tokenizer, layers=4, architecture="qwen2", tie_embeddings=True)
    math = Checkpoint.open(t["math"])
    assert "lm_head.weight" not in math.tensors
    assert math.tensors["model.layers.1.self_attn.q_proj.bias"].ptype == "q_proj.bias"
    plan = Plan(b=1, u=1, tb=1, tu=0)
    export_merge(math, Checkpoint.open(t["lang"]), plan, tmp_path / "o")
    assert_matches_plan(tmp_path / "o", t, plan)


@pytest.mark.parametrize("flags, msg", [
    (["--b", "5", "--u", "2", "--tb", "1", "--tu", "1"], "exceeds the model's 6 layers; reduce them so the sum is at most 6"),
    (["--b", "-1"], "b must be a whole number from 0 to 4,096 (got '-1')"),
    (["--b", "1", "--tb", "1", "--transition-weight", "1.2"], "transition weight must lie in [0, 1] (got 1.2)"),
])
def test_invalid_plan_cli(flags, msg, trio, tmp_path):
    r = run_cli("merge", "--math", str(trio["math"]), "--lang", str(trio["lang"]), *flags, "-o", str(tmp_path / "o"))
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr
    assert_nothing_written(tmp_path, tmp_path / "o")


def test_existing_output_is_not_touched(trio, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = run_cli("merge", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "-o", str(out))
    assert r.returncode == 2 and "already exists" in r.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    r = run_cli("merge", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "-o", str(out), "--overwrite")
    assert r.returncode == 2 and "not an earlier layerswap export" in r.stderr  # --overwrite replaces exports only
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_failure_midway_leaves_nothing(trio, tmp_path, monkeypatch):
    import layerswap.merge.merging as merging

    calls = {"n": 0}
    real = merging.linear

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk full")
        return real(*a, **k)

    monkeypatch.setattr(merging, "linear", flaky)
    with pytest.raises(RuntimeError):
        export_merge(Checkpoint.open(trio["math"]), Checkpoint.open(trio["lang"]), Plan(b=1, u=1, tb=2, tu=2),
                     tmp_path / "o")
    assert_nothing_written(tmp_path, tmp_path / "o")


def test_cuda_requested_without_gpu(trio, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = run_cli("merge", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "--device", "cuda",
                 "-o", str(tmp_path / "o"))
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr


def test_streaming_reads_are_bounded(trio, tmp_path, monkeypatch):
    """Computed tensors are read in slices of at most CHUNK_ELEMS, never memory-mapped whole."""
    import layerswap.merge.merging as merging

    monkeypatch.setattr(merging, "CHUNK_ELEMS", 512)
    sizes = []
    real = Checkpoint.read_into

    def spy(self, name, start, out):
        real(self, name, start, out)
        sizes.append(len(out) // 4)  # float32 elements

    def no_mmap(*a, **k):
        raise AssertionError("a tensor was memory-mapped whole")

    from layerswap.models import pairing

    monkeypatch.setattr(Checkpoint, "read_into", spy)
    monkeypatch.setattr(Checkpoint, "get", no_mmap)
    monkeypatch.setattr(pairing, "check_pairing", lambda *a, **k: pairing.Pairing({}, 0.5))  # only the merge's reads
    plan = Plan(b=1, u=1, tb=2, tu=2, transition="ramp")
    export_merge(Checkpoint.open(trio["math"]), Checkpoint.open(trio["lang"]), plan, tmp_path / "o")
    assert sizes and max(sizes) == 512  # the 64x128 MLP matrices (8192 elements) went in 16 slices
    assert_matches_plan(tmp_path / "o", trio, plan)


def test_reverted_layers_are_the_base_exactly(trio, tmp_path):
    """A layer the plan reverts holds the base's tensors byte for byte, on disk and in memory; the rest follows
    the plan as without the revert."""
    from layerswap import Recipe, UserError
    from layerswap.serving.workbench import Workbench

    plan = Plan(b=2, u=1, tb=1, tu=1, revert=(0, 3))
    math, lang, base = (Checkpoint.open(trio[r]) for r in ("math", "lang", "base"))
    with pytest.raises(UserError, match="reverts layers 0,3 to the base model: pass --base"):
        export_merge(math, lang, plan, tmp_path / "no-base")
    assert_nothing_written(tmp_path, tmp_path / "no-base")
    s = export_merge(math, lang, plan, tmp_path / "o", base=base)
    got, m, l, b = read_dir(tmp_path / "o"), read_dir(trio["math"]), read_dir(trio["lang"]), read_dir(trio["base"])
    reverted = 0
    for name in m:
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else None
        if layer in (0, 3):
            reverted += 1
            assert got[name].view(torch.uint8).flatten().tolist() == b[name].view(torch.uint8).flatten().tolist(), name
            if m[name].dim() == 2:  # the tiny experts leave norms at 1
                assert not torch.equal(got[name], m[name]) and not torch.equal(got[name], l[name]), name
        else:
            w = expected_weight(name, Plan(b=2, u=1, tb=1, tu=1), 6)
            assert torch.equal(got[name], expected_tensor(m[name], l[name], w)), name
    assert reverted == 2 * 9  # 9 tensors per Llama layer
    prov = json.loads((tmp_path / "o" / "layerswap.json").read_text())
    assert prov["reverted_layers"] == [0, 3] and prov["recipe"] == Recipe(plan=plan).to_dict()
    assert "base model (fine-tuning reverted)" in (tmp_path / "o" / "README.md").read_text()
    assert s.n_copied > 0

    wb = Workbench()
    wb.load(str(trio["math"]), str(trio["lang"]))
    with pytest.raises(UserError, match="reverts layers 0,3 to the base model: load the base"):
        wb.build(plan)
    wb.load(str(trio["math"]), str(trio["lang"]), str(trio["base"]))
    wb.build(plan)
    for k, v in wb.engines["merged"].model.state_dict().items():
        assert torch.equal(v, got[k]), k


def test_the_workbench_is_the_one_answer_to_does_the_merged_model_hold_this_recipe(trio):
    """`Workbench.holds` answers for the page, the lens and the search (no module compares recipes itself), and
    `ensure_built` builds only what is not held."""
    import re

    from layerswap.recipe.recipes import Recipe
    from layerswap.serving.workbench import Workbench
    from tests.helpers import REPO

    wb = Workbench()
    wb.load(str(trio["math"]), str(trio["lang"]))
    plan, other = PLANS["wide-ramp"], PLANS["none"]
    assert not wb.holds(plan)
    assert wb.ensure_built(plan) and wb.holds(plan) and wb.holds(Recipe(plan=plan)) and not wb.holds(other)
    assert not wb.ensure_built(Recipe(plan=plan))  # held: nothing runs
    assert wb.ensure_built(other) and wb.holds(other) and not wb.holds(plan)
    compares = re.compile(r"\.recipe\s*(==|!=)|recipe\.to_dict\(\)\s*==|wb\.recipe\.to_dict")
    elsewhere = [str(p.relative_to(REPO)) for p in (REPO / "layerswap").rglob("*.py")
                 if p.name != "workbench.py" and compares.search(p.read_text())]
    assert not elsewhere, f"these compare a workbench's recipe themselves; ask Workbench.holds: {elsewhere}"
