"""Every GPU decision, table-tested on the CPU: the hardware is data (`layerswap.core.hardware`, played by settings), and
the engine plan (`engines.planning.plan_engines`) is made for 8B-shaped experts (sparse files: headers only) on
each GPU size and Spaces flavour, with the engines it would release counted."""

from __future__ import annotations

import dataclasses

import pytest

from layerswap.core import hardware
from layerswap.models.checkpoints import Checkpoint
from layerswap.engines import Releasing, VLLMSettings
from layerswap.engines.planning import plan_engines, question_seconds
from layerswap.core.errors import UserError
from layerswap.core.hardware import GB, GiB, HELD, current, flavour
from tests.helpers import LLAMA_8B, sparse_llama


@pytest.fixture(autouse=True)
def nothing_held(monkeypatch):
    """Each test plays a GPU this process holds nothing on: engines an earlier test left in the pool would
    otherwise shrink the played GPU's free memory (the ledger is per process)."""
    monkeypatch.setattr(HELD, "_by", {})


def played_gpus(monkeypatch, gib: str, disk: int = 1000 * GB, ram: int = 64 * GB) -> hardware.Hardware:
    """`LAYERSWAP_GPU_MEMORY` plays the GPUs; RAM and disk are pinned too, since the setting keeps this machine's own
    (a CI runner with 15 GB of free disk has no room for an 8B merge's scratch copy: that is a plan of its own)."""
    monkeypatch.setenv("LAYERSWAP_GPU_MEMORY", gib)
    return dataclasses.replace(current(), disk_free=disk, ram_total=ram, ram_available=ram)


@pytest.fixture(scope="module")
def eight_b(tmp_path_factory) -> dict[str, Checkpoint]:
    root = tmp_path_factory.mktemp("sparse8b")
    return {r: Checkpoint.open(sparse_llama(root / r, **LLAMA_8B)) for r in ("math", "lang")}


@pytest.fixture(scope="module")
def demo(trio) -> dict[str, Checkpoint]:
    return {r: Checkpoint.open(trio[r]) for r in ("math", "lang")}


@pytest.mark.parametrize("gib, arrangement", [(80, "three_vllm"), (48, "two_vllm"), (40, "one_vllm_swapped"),
                                              (24, "one_vllm_swapped"), (16, "none")])
def test_8b_on_each_gpu_size(eight_b, monkeypatch, gib, arrangement):
    hw = played_gpus(monkeypatch, str(gib))
    assert hw.played and hw.device == "cuda" and hw.gpu_total() == gib * GiB
    plan = plan_engines(eight_b, hardware=hw)
    assert plan.row(hw)["arrangement"] == arrangement
    if arrangement == "none":
        assert not plan.fits and "What would serve them: `l4x1`" in plan.problem and "`a100-large`" in plan.problem
        return
    est = plan.estimate
    # weights in bf16, a model-sized KV cache (4 full 4096-token sequences of 8B: 512 MiB each), a CUDA context,
    # activations and CUDA graphs per engine, the app's headroom once; all within 90% of the GPU
    assert est.weights_bytes == (eight_b["math"].nbytes - 0) and est.kv_bytes == 4 * 512 * 2**20
    assert est.need_bytes == plan.vllm_engines * est.per_engine + est.fixed_bytes <= 0.9 * gib * GiB
    assert plan.cuda_graphs and not plan.settings.enforce_eager and plan.device == "cuda"
    share = plan.settings.gpu_memory_utilization * gib * GiB  # what each engine may take, as vLLM reads it
    assert est.per_engine <= share and plan.vllm_engines * share <= 0.9 * gib * GiB
    assert plan.question_seconds > 0 and plan.fits and not plan.transformers_first
    assert (plan.swap_seconds is None) == (arrangement == "three_vllm")


def test_spaces_flavours(eight_b, demo):
    """The Hub's own numbers (a100-large is the 80 GB A100), and what serves the literature's 8B trio on each."""
    rows = {name: plan_engines(eight_b, hardware=flavour(name)).row(flavour(name)) for name in hardware.FLAVOURS}
    assert {n: r["arrangement"] for n, r in rows.items()} == {
        "cpu-basic": "none", "cpu-upgrade": "none", "t4-small": "none", "l4x1": "one_vllm_swapped",
        "a10g-large": "one_vllm_swapped", "l40sx1": "two_vllm", "a100-large": "three_vllm", "h100": "three_vllm",
        "zero-gpu": "none"}
    assert rows["a100-large"]["gpu_memory_gib"] == 80.0 and rows["l40sx1"]["gpu_memory_gib"] == 45.0
    # the smallest cards that serve: a short context rather than no answers
    for name in ("l4x1", "a10g-large"):
        plan = plan_engines(eight_b, hardware=flavour(name))
        assert plan.short_context and plan.settings.max_model_len == 2048 and "2048-token context" in rows[name]["note"]
    assert not plan_engines(eight_b, hardware=flavour("a100-large")).short_context
    assert all((r["seconds_per_question"] is None) == (not r["fits"]) for r in rows.values())
    assert rows["a100-large"]["seconds_per_question"] < rows["l40sx1"]["seconds_per_question"] \
        < rows["a10g-large"]["seconds_per_question"]  # fewer swaps and more bandwidth: quicker
    assert "ZeroGPU" in rows["zero-gpu"]["note"] and "`a100-large`" in rows["zero-gpu"]["note"]
    # the demo's tiny models: vLLM is not installed on CPU Spaces (requirements.txt), transformers serves them
    tiny = {n: plan_engines(demo, hardware=flavour(n)) for n in ("cpu-basic", "a10g-large")}
    assert tiny["cpu-basic"].arrangement == "transformers" and tiny["cpu-basic"].device == "cpu"
    assert tiny["a10g-large"].arrangement == "three_vllm" and tiny["a10g-large"].analysis_device == "cuda"
    with pytest.raises(UserError, match="Unknown hardware 'a100'.*a100-large"):
        flavour("a100")


def test_trio_switch_counts_the_engines_it_releases(eight_b, tmp_path, monkeypatch):
    """Loading a second trio on an 80 GB GPU: the first trio's three engines hold 58 GiB; planned without them
    released, answers would drop to one engine; counted as released (as `ui.session.Shared` does), three again."""
    monkeypatch.setenv("LAYERSWAP_HARDWARE", "a100-large")
    first = plan_engines(eight_b)
    assert first.arrangement == "three_vllm"
    owner = object()
    HELD.hold(owner, first.need_memory)  # the played GPU now holds the first trio's engines, as a real one would
    try:
        other = {r: Checkpoint.open(sparse_llama(tmp_path / r, **LLAMA_8B)) for r in ("math", "lang")}
        blind = plan_engines(other)
        assert blind.arrangement == "none" or blind.vllm_engines < 3
        switch = plan_engines(other, releasing=Releasing(3, HELD.of(owner)))
        assert switch.arrangement == "three_vllm" and switch.releases == 3
        assert "counting 3 engines released first" in switch.describe()
    finally:
        HELD.release(owner)
    assert current().gpu_free() == flavour("a100-large").gpu_free()


def test_headroom_keeps_the_analysis_on_the_cpu_when_the_gpu_is_full(eight_b):
    roomy = plan_engines(eight_b, hardware=flavour("a100-large"))
    tight = plan_engines(eight_b, hardware=flavour("l40sx1"))
    assert roomy.analysis_device == "cuda" and tight.analysis_device == "cpu"


def test_played_hardware_starts_nothing(trio, monkeypatch):
    from layerswap.serving.workbench import Workbench

    monkeypatch.setenv("LAYERSWAP_GPU_MEMORY", "80")
    wb = Workbench(engine="auto")
    wb.check(str(trio["math"]), str(trio["lang"]), str(trio["base"]))
    assert wb.engine_plan.played and wb.engine_plan.fits
    with pytest.raises(UserError, match="played hardware"):
        wb.start()
    assert not wb.answering


def test_settings_override_the_machine(monkeypatch):
    this = current()
    assert this.name == "this" and not this.played and this.ram_available > 0
    monkeypatch.setenv("LAYERSWAP_GPU_MEMORY", "24,24")
    two = current()
    # a played card is usable but for the driver's reserve, stated once (hardware.CARD_RESERVE)
    assert len(two.gpus) == 2 and two.gpu_total() == 24 * GiB and two.gpu_free(2) == 24 * GiB - hardware.CARD_RESERVE
    monkeypatch.setenv("LAYERSWAP_AVAILABLE_MEMORY", str(2**20))  # a cap below what any machine has available
    assert current().gpu_free() == 2**20 and current().ram_available == 2**20
    monkeypatch.setenv("LAYERSWAP_GPU_MEMORY", "lots")
    with pytest.raises(UserError, match="LAYERSWAP_GPU_MEMORY"):
        current()
    monkeypatch.delenv("LAYERSWAP_GPU_MEMORY")
    monkeypatch.setenv("LAYERSWAP_HARDWARE", "zero-gpu")
    assert current().zero_gpu and current().played


def test_question_estimate(eight_b):
    nbytes = eight_b["math"].nbytes
    cpu = question_seconds("three_vllm", nbytes, current(), "cpu")
    assert cpu == pytest.approx(3 * 256 * nbytes / 7.0e9)
    a100 = flavour("a100-large")
    assert question_seconds("one_vllm_swapped", nbytes, a100, "cuda") > question_seconds("three_vllm", nbytes, a100, "cuda")
    assert question_seconds("none", nbytes, a100, "cuda") is None
    eager = plan_engines(eight_b, hardware=a100, settings=VLLMSettings(enforce_eager=True))
    assert not eager.cuda_graphs and eager.estimate.overhead_bytes < plan_engines(eight_b, hardware=a100).estimate.overhead_bytes


def test_hosting_docs_table_and_suggested_hardware_follow_the_plan(eight_b):
    """docs/hosting.md's 8B table is what `layerswap inspect --hardware` prints, and the README's
    `suggested_hardware` is the cheapest flavour serving the 8B trio as three engines side by side."""
    from layerswap.engines.planning import hardware_table, table_markdown
    from tests.helpers import REPO

    names = [n for n in hardware.FLAVOURS]
    rows = hardware_table(eight_b, names)
    assert table_markdown(rows) in (REPO / "docs" / "hosting.md").read_text()
    three = [r for r in rows if r["arrangement"] == "three_vllm" and hardware.FLAVOURS[r["hardware"]].price]
    cheapest = min(three, key=lambda r: hardware.FLAVOURS[r["hardware"]].price)["hardware"]
    assert f"suggested_hardware: {cheapest}\n" in (REPO / "README.md").read_text()


def test_inspect_hardware_json_for_an_8b_trio(tmp_path):
    import json

    from tests.helpers import run_cli

    for r in ("math", "lang"):
        sparse_llama(tmp_path / r, **LLAMA_8B)
    out = run_cli("inspect", "--math", str(tmp_path / "math"), "--lang", str(tmp_path / "lang"),
                  "--hardware", "a100-large,l40sx1,cpu-basic", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [(r["hardware"], r["arrangement"], r["fits"]) for r in rows] == [
        ("a100-large", "three_vllm", True), ("l40sx1", "two_vllm", True), ("cpu-basic", "none", False)]
    assert {"hardware", "gpu_memory_gib", "ram_gib", "arrangement", "fits", "seconds_per_question", "note"} <= set(rows[0])
    assert rows[0]["seconds_per_question"] > 0 and rows[2]["seconds_per_question"] is None
    every = run_cli("inspect", "--math", str(tmp_path / "math"), "--lang", str(tmp_path / "lang"),
                    "--hardware", ",".join(hardware.FLAVOURS), "--json")
    for r in json.loads(every.stdout):  # what the engines take is within the card's usable memory (less 10 %)
        if r["gpu_planned_gib"] is not None:
            assert r["fits"] and r["gpu_planned_gib"] <= 0.9 * r["gpu_usable_gib"] < r["gpu_memory_gib"], r
        ram = hardware.FLAVOURS[r["hardware"]].ram_available / GiB
        assert r["host_pinned_gib"] <= 0.9 * ram and (r["host_pinned_gib"] > 0) == r["sleep"], r
    bad = run_cli("inspect", "--math", str(tmp_path / "math"), "--lang", str(tmp_path / "lang"), "--hardware", "a100")
    assert bad.returncode != 0 and "Unknown hardware 'a100'" in bad.stdout + bad.stderr


def test_zero_gpu_serves_the_page_with_answers_off_and_the_hardware_to_pick(tmp_path):
    """On ZeroGPU (`SPACES_ZERO_GPU=true`) the app starts as a Space would (no CUDA call, no engine): the page is
    served (HTTP 200), the report says answers are off and which hardware to pick, and heatmaps, lens and export
    work on the CPU; asking is refused with the same reason."""
    import json
    import urllib.request

    from gradio_client import Client

    from tests.helpers import launch_app, shown

    app = launch_app(tmp_path, mgsm_dir=None, env_extra={"SPACES_ZERO_GPU": "true", "LAYERSWAP_HOSTED": "0",
                                                         "CUDA_VISIBLE_DEVICES": ""})
    url = next(app)
    try:
        assert urllib.request.urlopen(url, timeout=30).status == 200
        log = (tmp_path / "app.log").read_text()
        assert "Answers are off on ZeroGPU" in log and "daily quota" in log and "`cpu-basic`" in log
        client = Client(url, verbose=False)
        report, *_ = client.predict("assets:demo/base", "assets:demo/math", "assets:demo/lang", api_name="/load")
        assert "compatible: LlamaForCausalLM" in report
        assert "Answers are off:" in report and "ZeroGPU" in report and "What would serve them" in report, report
        heat, *_ = client.predict(api_name="/heatmap")
        assert json.loads(shown(heat)["plot"])["data"][0]["type"] == "heatmap"
        msg, _ = client.predict(str(tmp_path / "merged"), False, 1, 1, 0, 0, "flat", 0.5, "math", api_name="/export")
        assert "Wrote" in msg and (tmp_path / "merged" / "model.safetensors").exists()
        plan = (2, 0, 0, 0, "flat", 0.5, "neighbour", "swap", "", 4, 0, 0, "all", "layer_swap", 0.5, 1.0, 0.2, 0.9,
                "1,1", "")
        summary, curves, *_ = client.predict("xx", 3, "", "", 2, 0, *plan, api_name="/lens")
        assert "Token classes:" in summary and shown(curves)["plot"]
        with pytest.raises(Exception, match="ZeroGPU"):
            client.predict("en", None, "What is 2 + 3?", 24, api_name="/ask")
    finally:
        app.close()


def test_refresh_mode_is_the_plans(eight_b, demo, monkeypatch):
    """How a Build reaches the merge's engine is decided by the planner: in memory where the engine runs in this
    process (vLLM on the CPU, transformers; no scratch disk needed), through disk where vLLM's engine core is a
    process of its own (a GPU), the plan's scratch disk checked then."""

    cpu = dataclasses.replace(flavour("cpu-upgrade"), vllm=True, disk_free=0)  # vLLM on the CPU, no disk at all
    plan = plan_engines(demo, hardware=cpu)
    assert plan.engine == "vllm" and plan.device == "cpu" and plan.fits
    assert (plan.refresh, plan.scratch_bytes) == ("memory", 0) and "in this process" in plan.refresh_why
    assert "refreshes the merge's engine in memory" in plan.describe() and plan.row(cpu)["refresh"] == "memory"
    tr = plan_engines(demo, engine="transformers", hardware=cpu)
    assert tr.refresh == "memory" and tr.row(cpu)["refresh"] == "memory" and "refreshes" not in tr.describe()
    gpu = played_gpus(monkeypatch, "80")
    plan = plan_engines(eight_b, hardware=gpu)
    assert plan.arrangement == "three_vllm" and plan.refresh == "disk" and "process of its own" in plan.refresh_why
    assert plan.scratch_bytes == eight_b["math"].nbytes and "through disk" in plan.describe()
    assert plan.row(gpu)["refresh"] == "disk"
    full = plan_engines(eight_b, engine="vllm", hardware=dataclasses.replace(gpu, disk_free=10**9), alternatives=False)
    assert not full.fits and "loads the merged model from disk" in full.problem
    short = plan_engines(eight_b, hardware=dataclasses.replace(gpu, disk_free=15 * GB))  # no room: transformers serves
    assert short.fits and short.engine == "transformers" and short.scratch_bytes == 0


def test_sleep_mode_where_models_take_turns_and_the_host_can_park_them(eight_b):
    """On a GPU, models that take turns get engines of their own in vLLM's sleep mode when host RAM holds what they
    pin (1.4× the weights of every engine taking turns: vLLM's measured figure, kept after wake-up) and the GPU the
    sleeping engines' CUDA contexts and graphs; a swap then costs vLLM's measured sleep and wake times."""

    from layerswap.engines.planning import PINNED_PER_WEIGHT, sleep_mode
    from layerswap.engines.sizing import CUDA_CONTEXT, CUDA_GRAPHS

    per_model = eight_b["math"].nbytes
    card = dataclasses.replace(flavour("l40sx1"), gpus=(hardware.played_gpu(48 * GiB, "a 48 GiB card"),))
    plan = plan_engines(eight_b, hardware=card)
    assert plan.arrangement == "two_vllm" and plan.sleep and plan.settings.sleep_mode
    assert plan.swap_seconds == pytest.approx(per_model / GiB * (10.57 + 2.19) / 15.3)
    assert plan.host_pinned == int(2 * PINNED_PER_WEIGHT * per_model)  # the language expert's and the merge's
    row = plan.row(card)
    assert row["host_pinned_gib"] == round(plan.host_pinned / GiB, 2) and row["sleep"]
    assert row["gpu_planned_gib"] == round(plan.need_memory / GiB, 2) <= row["gpu_usable_gib"]
    est = plan.estimate
    assert est.need_bytes == 2 * est.per_engine + GiB + (CUDA_CONTEXT + CUDA_GRAPHS) == plan.need_memory
    assert plan.settings.gpu_memory_utilization * card.gpu_total() >= est.per_engine
    assert "sleep mode" in plan.describe() and "1 asleep at a time" in plan.sleep_why
    # 40 GiB of RAM held one parked model (the old budget) but not what two engines pin: weights are reloaded
    reload = plan_engines(eight_b, hardware=dataclasses.replace(card, ram_available=40 * GiB))
    assert reload.arrangement == "two_vllm" and not reload.sleep and not reload.settings.sleep_mode
    assert "host RAM" in reload.sleep_why and reload.swap_seconds == pytest.approx(per_model / 2e9)
    assert reload.row(card)["host_pinned_gib"] == 0
    # l40sx1's 45 GiB less the driver's reserve leaves no room for a sleeping engine's CUDA context
    l40 = plan_engines(eight_b, hardware=flavour("l40sx1"))
    assert l40.arrangement == "two_vllm" and not l40.sleep and "GPU memory that is not there" in l40.sleep_why
    a10g = plan_engines(eight_b, hardware=flavour("a10g-large"))
    assert a10g.arrangement == "one_vllm_swapped" and not a10g.sleep and "host RAM" in a10g.sleep_why
    assert not plan_engines(eight_b, hardware=card, serving="one").sleep  # three engines would pin 62.8 GiB
    one = plan_engines(eight_b, hardware=dataclasses.replace(card, ram_available=142 * GB), serving="one")
    assert one.sleep and "2 asleep at a time" in one.sleep_why and one.host_pinned == int(3 * 1.4 * per_model)
    assert not plan_engines(eight_b, hardware=flavour("a100-large")).sleep
    assert sleep_mode("one_vllm_swapped", "cpu", card, est, per_model) == (0, "vLLM's sleep mode is for GPUs")


class Sleeper:
    """Stand-in for a `VLLMEngine` in sleep mode (which needs a GPU): records the calls `Turns` makes of it in
    `log`, and answers with its name, awake only."""

    def __init__(self, name: str, log: list[str], asleep: bool = False, holding=None):
        self.name, self.log, self.asleep, self.holding = name, log, asleep, holding  # holding: the folder loaded

    def sleep(self):
        if not self.asleep:
            self.log.append(f"sleep {self.name}")
            self.asleep = True

    def wake(self):
        if self.asleep:
            self.log.append(f"wake {self.name}")
            self.asleep = False

    def generate(self, prompts, **kw):
        assert not self.asleep, f"{self.name} answered asleep"
        return [self.name for _ in prompts]


def test_turns_put_the_others_to_sleep_before_one_wakes():
    """`Turns` (sleep mode's coordination): the engine asked for wakes only after every other one sleeps, so the
    GPU memory it takes back is free; an engine already awake is not woken again."""
    from layerswap.engines.vllm_engine import TurnEngine, Turns

    log: list[str] = []
    turns = Turns([Sleeper("lang", log, asleep=True), Sleeper("merged", log)])
    lang, merged = (TurnEngine(turns, e) for e in turns.engines)
    assert lang.generate(["q"]) == ["lang"] and log == ["sleep merged", "wake lang"]
    assert [e.name for e in turns.engines if not e.asleep] == ["lang"]
    assert lang.generate(["q"]) == ["lang"] and len(log) == 2
    assert merged.generate(["q", "r"]) == ["merged", "merged"] and log[2:] == ["sleep lang", "wake merged"]
    assert turns.awake is turns.engines[1]


def test_sleep_mode_starts_an_engine_per_model_each_asleep_before_the_next(eight_b, monkeypatch):
    """The arrangement of a sleep-mode plan (a 48 GiB card, 8B: two engines, the language expert and the merge taking
    turns): the math expert's engine, then the language expert's, asleep before the merge's starts; the models'
    engines take turns when asked. vLLM's sleep mode needs a GPU, so the engines here are stand-ins that record
    the calls `VLLMEngine` would get; the plan is the real one."""
    from layerswap.serving.answering import ARRANGEMENTS, Trio
    from layerswap.engines.vllm_engine import TurnEngine, VLLMEngine
    from layerswap.serving.workbench import MERGES

    card = dataclasses.replace(flavour("l40sx1"), gpus=(hardware.played_gpu(48 * GiB, "a 48 GiB card"),))
    plan = plan_engines(eight_b, hardware=card)
    assert plan.sleep and plan.arrangement == "two_vllm"
    log: list[str] = []
    started: list[Sleeper] = []

    def start(path):
        log.append(f"start {path.name} ({sum(not e.asleep for e in started)} awake)")
        started.append(Sleeper(path.name, log, holding=path))
        return started[-1]

    monkeypatch.setattr(VLLMEngine, "idle_for", classmethod(lambda cls, path, close_others=True: 0))
    monkeypatch.setattr(VLLMEngine, "acquire", classmethod(lambda cls, path, settings, **kw: start(path)))
    arr = ARRANGEMENTS[plan.arrangement](plan, Trio(eight_b, merges=MERGES))
    arr.start(None, lambda f, d: None)
    assert log == ["start math (0 awake)", "start lang (1 awake)", "sleep lang", "start math (1 awake)"]
    assert isinstance(arr.engines["lang"], TurnEngine) and arr.engines["math"] is started[0]
    assert arr.describe().endswith("holding now: math expert, no merge yet awake, 1 asleep")
    # the merge's engine (started on the math expert's folder) sleeps, the language expert's wakes
    assert arr.engines["lang"].generate(["q"]) == ["lang"] and log[-2:] == ["sleep math", "wake lang"]
    assert arr.describe().endswith("holding now: math expert, language expert awake, 1 asleep")


def test_startup_report_names_driver_and_cuda_and_warns_when_torch_sees_no_gpu(tmp_path, monkeypatch):
    """A fake `nvidia-smi` plays a GPU machine; torch here is the CPU build, so the report must say torch sees none."""
    import torch

    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\nif [ \"$1\" = -L ]; then echo 'GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-1)'; else "
                   "echo '| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4 |'; fi\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines = hardware.startup_report()
    assert "NVIDIA A100-SXM4-80GB" in lines[0] and "driver 550.54.15" in lines[1] and "CUDA 12.4" in lines[1]
    assert lines[-1].startswith("WARNING: this machine has an NVIDIA GPU but torch sees none")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not any(x.startswith("WARNING") for x in hardware.startup_report())
    monkeypatch.setenv("PATH", str(tmp_path / "none"))  # no nvidia-smi: one line, no warning
    assert len(hardware.startup_report()) == 1
