"""Issue 40: the engine plan of a family (one math expert, N language experts, N merges), table-tested on the CPU
with played hardware: which models are awake, which sleep or are reloaded, what a language switch costs; and
`layerswap inspect --hardware` over a family."""

from __future__ import annotations

import dataclasses
import json

import pytest

from layerswap.core import hardware
from layerswap.core.hardware import GB, GiB, HELD, flavour
from layerswap.engines.family import plan_family
from layerswap.engines.planning import PINNED_PER_WEIGHT, plan_engines, sleep_swap_seconds, swap_seconds
from layerswap.models.checkpoints import Checkpoint
from tests.helpers import LLAMA_8B, sparse_llama


@pytest.fixture(autouse=True)
def nothing_held(monkeypatch):
    monkeypatch.setattr(HELD, "_by", {})


@pytest.fixture(scope="module")
def eight_b_family(tmp_path_factory) -> dict[str, Checkpoint]:
    """An 8B math expert and eight 8B language experts (sparse files: headers only)."""
    root = tmp_path_factory.mktemp("family8b")
    return {r: Checkpoint.open(sparse_llama(root / r, **LLAMA_8B)) for r in ("math", *(f"l{i}" for i in range(8)))}


def _langs(cks: dict[str, Checkpoint], n: int) -> dict[str, Checkpoint]:
    return {f"l{i}": cks[f"l{i}"] for i in range(n)}


def card(gib: float, ram_gb: float) -> hardware.Hardware:
    return dataclasses.replace(flavour("a100-large"), name=f"{gib:g}g", ram_total=int(ram_gb * GB),
                               ram_available=int(ram_gb * GB),
                               gpus=(hardware.played_gpu(int(gib * GiB), f"a {gib:g} GiB card", 2e12),))


# hardware, languages -> the trio's arrangement, the family's residency, awake, asleep, reloaded per switch
CASES = [
    (card(141, 500), 2, "three_vllm", "all_awake", 5, 0, 0),  # 5 engines of 19 GiB fit in 0.9 × 140 GiB
    (card(141, 500), 4, "three_vllm", "sleep", 3, 6, 0),  # 9 do not: the other 3 languages' 6 engines sleep
    (card(141, 120), 4, "three_vllm", "reload", 3, 0, 2),  # 8 sleeping-capable engines would pin 168 GiB
    (flavour("a100-large"), 2, "three_vllm", "sleep", 3, 2, 0),
    (flavour("a100-large"), 4, "three_vllm", "reload", 3, 0, 2),  # 142 GB of RAM: 8 × 1.4 × 15 GiB do not fit
    (flavour("h100"), 4, "three_vllm", "sleep", 3, 6, 0),  # 250 GB of RAM park them
    (flavour("h100"), 8, "three_vllm", "reload", 3, 0, 2),
    (flavour("l40sx1"), 3, "two_vllm", "reload", 2, 0, 2),  # the trio takes turns without sleep mode
    (flavour("cpu-basic"), 2, "none", "none", 0, 0, 0),
]


@pytest.mark.parametrize("hw, n, arrangement, residency, awake, asleep, reloaded", CASES,
                         ids=[f"{c[0].name}-{c[1]}" for c in CASES])
def test_8b_family_on_each_hardware(eight_b_family, hw, n, arrangement, residency, awake, asleep, reloaded):
    math, langs = eight_b_family["math"], _langs(eight_b_family, n)
    fp = plan_family(math, langs, hardware=hw)
    trio = plan_engines({"math": math, "lang": langs["l0"]}, hardware=hw, alternatives=False)
    assert fp.trio.arrangement == trio.arrangement == arrangement and fp.models == 1 + 2 * n
    assert (fp.residency, fp.awake, fp.asleep, fp.reloaded) == (residency, awake, asleep, reloaded), fp.why
    per_model = math.nbytes  # bf16 as served
    usable_gpu = 0.9 * hw.gpu_free()
    if residency == "none":
        assert not fp.fits and fp.switch_seconds is None and fp.row(hw)["arrangement"] == "none"
        return
    assert fp.need_memory <= usable_gpu and fp.host_pinned <= 0.9 * hw.ram_available
    if residency == "all_awake":
        assert fp.switch_seconds == 0 and fp.need_memory > trio.need_memory
    elif residency == "sleep":
        sleepers = 2 * n
        assert fp.host_pinned == int(sleepers * PINNED_PER_WEIGHT * per_model)
        assert fp.switch_seconds == pytest.approx(2 * sleep_swap_seconds(per_model))
        assert fp.need_memory > trio.need_memory
    else:
        assert fp.switch_seconds == pytest.approx(2 * swap_seconds(per_model, "cuda"))
        assert fp.need_memory == trio.need_memory
    row = fp.row(hw)
    assert set(trio.row(hw)) <= set(row) and row["residency"] == residency and row["languages"] == n
    assert row["gpu_planned_gib"] == round(fp.need_memory / GiB, 2)
    assert row["host_pinned_gib"] == round(fp.host_pinned / GiB, 2)


def test_small_family_on_the_cpu_keeps_the_experts_in_memory_when_they_fit(trio):
    """On a CPU with transformers: every expert in memory when they fit (a switch rebuilds the merge), else each
    language's expert read from disk at its switch; the seconds are the plan's reload rate."""
    math, lang = Checkpoint.open(trio["math"]), Checkpoint.open(trio["lang"])
    langs = {"xx": lang, "yy": Checkpoint.open(trio["lang"]), "zz": Checkpoint.open(trio["lang"])}
    cpu = flavour("cpu-basic")
    fp = plan_family(math, langs, hardware=cpu)
    assert fp.trio.arrangement == "transformers" and fp.residency == "resident" and fp.awake == 2 + 3
    assert fp.switch_seconds == pytest.approx(swap_seconds(math.nbytes, "cpu")) and fp.reloaded == 1
    assert fp.need_memory == math.nbytes + 3 * lang.nbytes + 2**30
    # RAM for the trio but not for all four experts: reloaded per language
    tight = dataclasses.replace(cpu, ram_available=fp.trio.need_memory + lang.nbytes // 2)
    fp2 = plan_family(math, langs, hardware=tight)
    assert fp2.trio.fits and fp2.residency == "reload" and fp2.reloaded == 2
    assert fp2.switch_seconds == pytest.approx(2 * swap_seconds(math.nbytes, "cpu"))
    assert "language switch: about" in fp2.describe() or "under a second" in fp2.describe()
    one = plan_family(math, {"xx": lang}, hardware=cpu)
    assert one.residency == "trio" and one.switch_seconds == 0


def test_inspect_hardware_answers_for_a_family(tmp_path):
    from tests.helpers import cli_in_process

    for r in ("math", "sw", "te", "bn"):
        sparse_llama(tmp_path / r, **LLAMA_8B)
    langs = [a for c in ("sw", "te", "bn") for a in ("--lang", f"{c}={tmp_path / c}")]
    out = cli_in_process("inspect", "--math", str(tmp_path / "math"), *langs, "--hardware", "h100,l40sx1,cpu-basic",
                         "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [(r["hardware"], r["arrangement"], r["residency"], r["languages"], r["models"]) for r in rows] == [
        ("h100", "three_vllm", "sleep", 3, 7), ("l40sx1", "two_vllm", "reload", 3, 7),
        ("cpu-basic", "none", "none", 3, 7)]
    assert rows[0]["seconds_per_switch"] > 0 and rows[0]["asleep"] == 4 and rows[2]["seconds_per_switch"] is None
    md = cli_in_process("inspect", "--math", str(tmp_path / "math"), *langs, "--hardware", "h100")
    assert md.returncode == 0 and "| `h100` |" in md.stdout and "`sleep`" in md.stdout
    # a pair answers as before
    pair = cli_in_process("inspect", "--math", str(tmp_path / "math"), "--lang", str(tmp_path / "sw"), "--hardware",
                          "h100", "--json")
    assert "residency" not in json.loads(pair.stdout)[0]


def test_hosting_docs_family_table_follows_the_plan(tmp_path):
    """docs/hosting.md's table of the paper's 8B family (four language experts) is what the plan says."""
    from layerswap.engines.family import family_hardware_table, family_table_markdown
    from tests.helpers import REPO

    cks = {r: Checkpoint.open(sparse_llama(tmp_path / r, **LLAMA_8B)) for r in ("math", "sw", "te", "bn", "ja")}
    rows = family_hardware_table(cks.pop("math"), cks, list(hardware.FLAVOURS))
    assert family_table_markdown(rows) in (REPO / "docs" / "hosting.md").read_text()


def test_a_lora_family_is_planned_for_the_highest_rank_any_member_needs(vllm_trio, tmp_path, monkeypatch):
    """LoRA experts on one engine on the base: the family's trio is planned on the member whose merge needs the
    highest rank (not the largest in bytes), in any order, so the engine serves every member; a member vLLM's LoRA
    cannot serve (embedding LoRA) makes the whole family dense."""
    from layerswap.engines.family import planned_on
    from layerswap.engines.vllm_engine import VLLMSettings
    from layerswap.models.adapters import open_expert
    from tests.helpers import make_adapter

    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path / "cache"))
    base = vllm_trio["base"]
    math = open_expert(make_adapter(base, tmp_path / "m", "lora", 0))
    wide = open_expert(make_adapter(base, tmp_path / "wide", "lora", 1))  # rank 4 on every layer
    deep = open_expert(make_adapter(base, tmp_path / "deep", "lora", 2, layers=[1], rank=8))  # rank 8 on one layer
    emb = open_expert(make_adapter(base, tmp_path / "emb", "lora", 3, embed=True))
    assert wide.nbytes >= deep.nbytes  # the largest is not the one the engine must be started for
    hw = dataclasses.replace(flavour("cpu-upgrade"), vllm=True, ram_available=100 * GiB)
    s = VLLMSettings(kv_cache_gib=0.5)
    for langs in ({"qa": wide, "qb": deep}, {"qb": deep, "qa": wide}):
        assert planned_on(math, langs) is deep
        fp = plan_family(math, langs, engine="vllm", settings=s, hardware=hw)
        assert fp.trio.arrangement == "lora_vllm" and fp.residency == "adapters"
        assert fp.trio.settings.max_lora_rank == 16  # 4 + 8 = 12, the next rank vLLM takes
    assert planned_on(math, {"qa": wide}) is wide
    dense = plan_family(math, {"qa": wide, "qe": emb}, engine="vllm", settings=s, hardware=hw)
    assert planned_on(math, {"qa": wide, "qe": emb}) is emb
    assert dense.trio.arrangement == "three_vllm" and "embedding LoRA" in dense.trio.dense_why
    plain = {"l": Checkpoint.open(vllm_trio["lang"])}
    assert planned_on(Checkpoint.open(vllm_trio["math"]), plain) is plain["l"]
