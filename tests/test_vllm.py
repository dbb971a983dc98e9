"""vLLM for real (CPU build in CI): one engine for the whole module, reused through the pool.

The engine is started once on the math expert; every later use (other experts, merges, the CLI)
reloads weights into it. Each test that goes through the pool checks, on its own, that it got this
engine back rather than a new one (no test depends on another having run).
"""

from __future__ import annotations

import json

import pytest

from layerswap import Plan, UserError
from layerswap.evaluation import mgsm
from layerswap.cli import main as cli
from layerswap.engines import TransformersEngine, VLLMEngine, open_engine
from tests.helpers import vllm_or_skip

NEW = 24
WEIGHTS_READ = "Loading safetensors checkpoint shards: 100%"  # what vLLM logs as an engine reads its weights


@pytest.fixture(scope="module")
def probes(mgsm_dir) -> dict[str, list[str]]:
    """Short MGSM prompts, and long 8-shot prompts sharing a prefix far longer than one 128-token KV block."""
    en, sw = mgsm.get_language("en"), mgsm.get_language("sw")
    ex = mgsm.load_exemplars("en", mgsm_dir)
    short = [mgsm.build_prompt(it.question, sw) for it in mgsm.load("sw", mgsm_dir)[:4]]
    long = [mgsm.build_prompt(it.question, en, exemplars=ex, shots=4) for it in mgsm.load("en", mgsm_dir)[:3]]
    return {"short": short, "long": long}


@pytest.fixture(scope="module")
def engine(vllm_trio, probes):
    """The session's one vLLM engine, with the answers it gave right after starting (fresh) on the math expert."""
    vllm_or_skip()
    import numba  # noqa: F401  the app's analysis loads it before any engine starts (llvmlite's ffi.lib broke vLLM's start)

    eng = VLLMEngine.acquire(vllm_trio["math"])
    fresh = {k: eng.generate(v, max_new_tokens=NEW) for k, v in probes.items()}
    common = len(probes["long"][0]) - len(probes["long"][0].split("\n\n")[-1])
    assert len(eng.encode(probes["long"][0][:common])) > 2 * 128, "long prompts must share several KV blocks"
    eng.release()
    yield eng, fresh


def test_same_answers_as_transformers(engine, vllm_trio, probes):
    eng, fresh = engine
    eng.ensure(vllm_trio["math"])
    tr = TransformersEngine.from_pretrained(vllm_trio["math"])
    prompts = probes["short"] + probes["long"]
    assert tr.generate(prompts, max_new_tokens=NEW, stop=["Swali:"]) == eng.generate(prompts, max_new_tokens=NEW,
                                                                                    stop=["Swali:"])
    assert fresh["short"] == tr.generate(probes["short"], max_new_tokens=NEW)
    assert eng.tokens_generated > 0


def test_live_refresh_equals_a_fresh_engine_with_long_shared_prefix(engine, vllm_trio, probes):
    eng, fresh = engine
    eng.refresh(vllm_trio["lang"])
    lang_out = eng.generate(probes["long"], max_new_tokens=NEW)  # fills the prefix cache with the lang expert's KV
    assert lang_out != fresh["long"], "the experts must answer differently for this test to mean anything"
    seconds = eng.refresh(vllm_trio["math"])
    assert seconds < 30
    assert eng.generate(probes["long"], max_new_tokens=NEW) == fresh["long"]
    assert eng.generate(probes["short"], max_new_tokens=NEW) == fresh["short"]


def test_without_prefix_cache_reset_answers_go_stale(engine, vllm_trio, probes):
    """The trap the reset avoids: reused KV blocks from the previous weights change the answers."""
    eng, fresh = engine
    eng.refresh(vllm_trio["lang"])
    eng.generate(probes["long"], max_new_tokens=NEW)
    eng.refresh(vllm_trio["math"], reset_prefix_cache=False)
    stale = eng.generate(probes["long"], max_new_tokens=NEW)
    assert stale != fresh["long"]
    assert eng.llm.reset_prefix_cache()
    assert eng.generate(probes["long"], max_new_tokens=NEW) == fresh["long"]


def test_refresh_refuses_another_shape(engine, trio):
    eng, _ = engine
    with pytest.raises(Exception, match="same config and tokenizer"):
        eng.refresh(trio["math"])


def test_workbench_serves_all_three_on_one_engine(engine, vllm_trio, mgsm_dir, tmp_path, monkeypatch):
    """One engine swapped between the three models; each Build refreshes it in memory (the plan's refresh
    ``memory``: the engine runs in this process), answering exactly as the transformers engine on the same merge,
    with nothing written to the scratch folder."""
    from layerswap.engines import TensorWeights
    from layerswap.serving.workbench import Workbench

    eng, _ = engine
    scratch = tmp_path / "scratch"
    monkeypatch.setenv("LAYERSWAP_SCRATCH", str(scratch))
    wb, tr = Workbench(engine="vllm", serving="one"), Workbench(engine="transformers")
    for w in (wb, tr):
        w.load(str(vllm_trio["math"]), str(vllm_trio["lang"]))
    assert wb.engine_plan.arrangement == "one_vllm_swapped" and wb.engine_note.startswith("one vLLM engine")
    assert wb.engine_plan.refresh == "memory" and wb.engine_plan.scratch_bytes == 0 and eng.in_process
    assert wb.engines["math"].engine is eng and wb.engines["lang"].engine is eng  # the idle pooled engine, reused
    plans = [Plan(b=1, u=1, tb=1, tu=0), Plan(b=2, u=1, tb=0, tu=1, non_layer="lang")]
    merged_answers = []
    for plan in plans:
        wb.build(plan)
        tr.build(plan)
        assert isinstance(wb.engines["merged"].weights, TensorWeights) and wb.answering_engines.current.merge_dir is None
        answers = wb.ask_mgsm("sw", 3, source=mgsm_dir, max_new_tokens=NEW)
        assert [a.engine for a in answers] == ["vllm"] * 3 and wb.engines["merged"].engine is eng
        assert isinstance(eng.holding, TensorWeights) and "holding now: merged model" in wb.engine_note
        # the merged model answers exactly as the transformers engine on the same merge
        assert [a.scored.output for a in answers] == [a.scored.output for a in tr.ask_mgsm(
            "sw", 3, source=mgsm_dir, max_new_tokens=NEW)]
        merged_answers.append(answers[2].scored.output)
    assert merged_answers[0] != merged_answers[1]
    assert not scratch.exists() or not any(scratch.iterdir()), "an in-memory refresh writes no scratch merge"
    wb.close()
    tr.close()
    assert not eng.in_use  # back in the pool


def test_eval_cli_experts_and_merge_on_vllm(engine, vllm_trio, mgsm_dir, tmp_path, capsys):
    running = VLLMEngine.pooled()
    out = tmp_path / "results.jsonl"
    rc = cli(["eval", "--math", str(vllm_trio["math"]), "--lang", str(vllm_trio["lang"]), "--b", "1", "--u", "1",
              "--engine", "vllm", "--serving", "one", "--langs", "sw,ja", "--limit", "3", "--max-new-tokens", "16",
              "--mgsm-dir", str(mgsm_dir), "-q", "-o", str(out)])
    text = capsys.readouterr().err
    assert rc == 0, text
    assert "engine: one vLLM engine, weights swapped per model" in text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 * 2 * 3
    assert {r["model"] for r in rows} == {"math expert", "language expert", "merged model"}
    assert {r["engine"] for r in rows} == {"vllm"}
    assert rows[0]["prompt"].startswith("Swali: ") and rows[0]["gold"] == mgsm.load("sw", mgsm_dir)[0].answer

    rc = cli(["eval", "--model", str(vllm_trio["lang"]), "--engine", "auto", "--langs", "sw", "--limit", "2",
              "--max-new-tokens", "8", "--mgsm-dir", str(mgsm_dir), "-q"])
    assert rc == 0 and "engine: answered by vLLM" in capsys.readouterr().err
    assert VLLMEngine.pooled() == running  # both commands were served by engines already running


def test_acquire_reuses_an_idle_engine_of_the_same_shape(engine, vllm_trio):
    eng, _ = engine
    idle = VLLMEngine.idle_for(vllm_trio["math"], close_others=False)
    got = VLLMEngine.acquire(vllm_trio["lang"])  # another model of the same shape: new weights, same engine
    try:
        assert got is eng and got.in_use and got.weights_path == vllm_trio["lang"].resolve()
        assert VLLMEngine.idle_for(vllm_trio["math"], close_others=False) == idle - 1  # not offered twice
    finally:
        got.release()
    assert VLLMEngine.idle_for(vllm_trio["math"], close_others=False) == idle


def test_engine_failing_to_start_falls_back_with_the_reason(vllm_trio):
    from layerswap.engines import EngineStartError, VLLMSettings

    vllm_or_skip()
    too_long = VLLMSettings(max_model_len=10**7)  # longer than the model's positions: vLLM refuses
    with pytest.raises(EngineStartError, match="vLLM could not start"):
        open_engine(vllm_trio["base"], engine="vllm", settings=too_long)
    eng, note = open_engine(vllm_trio["base"], engine="auto", settings=too_long)
    assert isinstance(eng, TransformersEngine) and note.startswith("answered by transformers: vLLM could not start")


@pytest.mark.slow
def test_workbench_three_engines_refresh_the_merged_one(vllm_trio, mgsm_dir, tmp_path):
    """Three engines side by side (starts two more engines: not part of CI, run with -m slow)."""
    from layerswap.serving.workbench import Workbench

    vllm_or_skip()
    wb = Workbench(engine="vllm", serving="three")
    wb.load(str(vllm_trio["math"]), str(vllm_trio["lang"]))
    assert wb.engine_plan.arrangement == "three_vllm" and "three vLLM engines" in wb.engine_note
    wb.build(Plan(b=1, u=1, tb=1, tu=0))
    merged, running = wb.engines["merged"], VLLMEngine.pooled()
    for i, plan in enumerate([Plan(b=2, u=1, tb=0, tu=1), Plan(b=1, u=2, tb=0, tu=0, non_layer="avg")]):
        wb.build(plan)
        assert wb.engines["merged"] is merged and VLLMEngine.pooled() == running  # refreshed, no engine started
        answers = wb.ask_mgsm("sw", 5, source=mgsm_dir, max_new_tokens=NEW)
        wb.export(tmp_path / f"m{i}")
        tr = TransformersEngine.from_pretrained(tmp_path / f"m{i}", use_chat_template=False)
        assert answers[2].scored.output == tr.generate([answers[2].prompt], NEW, mgsm.get_language("sw").stop)[0]
    wb.close()


def test_lora_experts_are_adapters_on_one_base_engine(vllm_trio, probes, tmp_path, monkeypatch):
    """Two LoRA experts: one vLLM engine on the base serves them and every merge as LoRA adapters (serving mode
    ``lora``); a new plan is a new adapter, the base engine is neither rebuilt nor reloaded, and every answer is the
    transformers engine's on the densified models."""
    from pathlib import Path

    from layerswap.serving.workbench import Workbench
    from tests.helpers import make_adapter

    vllm_or_skip()
    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path / "cache"))
    m = make_adapter(vllm_trio["base"], tmp_path / "m", "lora", 1, layers=range(1, 4), scale=0.5)
    l = make_adapter(vllm_trio["base"], tmp_path / "l", "lora", 2, scale=0.5)
    wb, tr = Workbench(engine="vllm"), Workbench(engine="transformers")
    for w in (wb, tr):
        w.load(str(m), str(l), str(vllm_trio["base"]), force=True)
    served = wb.answering_engines.current
    assert wb.engine_plan.arrangement == "lora_vllm" and "LoRA adapter" in wb.engine_note and len(served.vllm) == 1
    base = served.vllm[0]
    assert base.weights_path == Path(vllm_trio["base"]).resolve() and base.settings.max_lora_rank == 8
    seen = set()
    for plan in (Plan(b=1, u=1, tb=1, tu=0), Plan(b=2, u=0, tb=0, tu=1)):
        wb.build(plan)
        tr.build(plan)
        for role in ("math", "lang", "merged"):
            got = wb.engines[role].generate(probes["short"], max_new_tokens=NEW)
            assert got == tr.engines[role].generate(probes["short"], max_new_tokens=NEW), (plan, role)
            seen.add(tuple(got))
        assert served.vllm == [base] and base.weights_path == Path(vllm_trio["base"]).resolve()
    assert len(seen) >= 3, "the experts and merges must answer differently for this test to mean anything"
    # a family's language switch: the next LoRA expert is another adapter on the same engine (nothing reloaded)
    l2 = make_adapter(vllm_trio["base"], tmp_path / "l2", "lora", 3, scale=0.5)
    before = wb.engines["lang"].generate(probes["short"], max_new_tokens=NEW)
    assert wb.switch_problem(str(l2)) == ""
    for w in (wb, tr):
        w.switch_lang(str(l2), force=True)
        w.build(Plan(b=1, u=1, tb=1, tu=0))
    for role in ("math", "lang", "merged"):
        got = wb.engines[role].generate(probes["short"], max_new_tokens=NEW)
        assert got == tr.engines[role].generate(probes["short"], max_new_tokens=NEW), ("after the switch", role)
    assert wb.engines["lang"].generate(probes["short"], max_new_tokens=NEW) != before
    assert served.vllm == [base] and wb.answering_engines.current is served
    # one whose merge needs a higher rank than the engine started with (4 + 8 > 8): refused, nothing changed
    wide = make_adapter(vllm_trio["base"], tmp_path / "r8", "lora", 4, scale=0.5, rank=8)
    problem = wb.switch_problem(str(wide))
    assert "language expert r8 needs LoRA rank 16 for its merge; the running vLLM engine serves up to 8" in problem
    with pytest.raises(UserError, match="needs LoRA rank 16"):
        wb.switch_lang(str(wide), force=True)
    assert Path(wb.checkpoints["lang"].adapter).name == "l2" and wb.engines["lang"].generate(
        probes["short"], max_new_tokens=NEW) == tr.engines["lang"].generate(probes["short"], max_new_tokens=NEW)
    wb.close()
    tr.close()


def test_two_engines_the_language_expert_and_the_merge_swapped(engine, vllm_trio, mgsm_dir, tmp_path):
    """`two_vllm`: the math expert on the pooled engine, the language expert and the merge swapped on a second one;
    the engine line names what each holds, and the merge answers as transformers does on its export."""
    from layerswap.serving.workbench import Workbench

    from dataclasses import replace

    eng, _ = engine
    wb = Workbench(engine="vllm", serving="two")
    wb.check(str(vllm_trio["math"]), str(vllm_trio["lang"]))
    wb.engine_plan = replace(wb.engine_plan, refresh="disk")  # as a GPU's plan decides (engine core in its process)
    wb.start()
    try:
        assert wb.engine_plan.arrangement == "two_vllm" and wb.engines["math"] is eng
        assert wb.engines["lang"].engine is not eng and wb.engine_note.startswith("two vLLM engines")
        wb.build(Plan(b=1, u=1, tb=1, tu=0))
        answers = wb.ask_mgsm("sw", 3, source=mgsm_dir, max_new_tokens=NEW)
        assert wb.engine_note.endswith("holding now: math expert, merged model")
        merge_dir = wb.answering_engines.current.merge_dir  # refresh "disk": exported, then reloaded from there
        assert (merge_dir / "config.json").exists() and not (merge_dir / "README.md").exists()
        wb.export(tmp_path / "m")
        tr = TransformersEngine.from_pretrained(tmp_path / "m", use_chat_template=False)
        assert answers[2].scored.output == tr.generate([answers[2].prompt], NEW, mgsm.get_language("sw").stop)[0]
    finally:
        wb.close()
    assert not eng.in_use


def test_sleep_mode_is_refused_on_the_cpu_before_anything_starts(vllm_trio):
    """The plan never asks for sleep mode off a GPU; an engine asked for it there says so instead of starting."""
    vllm_or_skip()
    from layerswap.engines.vllm_engine import EngineStartError, VLLMSettings

    with pytest.raises(EngineStartError, match="sleep mode needs a GPU"):
        VLLMEngine(vllm_trio["math"], VLLMSettings(sleep_mode=True))


def test_the_page_serves_lora_experts_as_adapters_on_one_vllm_engine(vllm_trio, mgsm_dir, tmp_path, monkeypatch):
    """Issue 34 on the page under vLLM: a visitor loads two LoRA experts; one vLLM engine on the base serves the
    experts and each merge as LoRA adapters (the report says so), a new plan answers without a new engine, and every
    answer is the one transformers gives on the densified models."""
    from gradio_client import Client

    from layerswap.serving.workbench import Workbench
    from tests.helpers import launch_app, make_adapter

    vllm_or_skip()
    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path / "cache"))
    refs = (str(vllm_trio["base"]),
            str(make_adapter(vllm_trio["base"], tmp_path / "m", "lora", 1, layers=range(1, 4), scale=0.5)),
            str(make_adapter(vllm_trio["base"], tmp_path / "l", "lora", 2, scale=0.5)))
    ref = Workbench(engine="transformers")
    ref.load(refs[1], refs[2], refs[0], force=True)
    app = launch_app(tmp_path, mgsm_dir=mgsm_dir, env_extra={"LAYERSWAP_ENGINE": "vllm"})
    log = tmp_path / "app.log"
    try:
        client = Client(next(app), verbose=False)
        report, *_ = client.predict(*refs, True, api_name="/load")
        assert "compatible: LlamaForCausalLM, 4 layers" in report, report
        report = client.predict(api_name="/start_engines")  # waits for the planned engine
        assert "one vLLM engine on the base, each model a LoRA adapter on it" in report, report
        seen, reads = set(), []
        for plan in ((1, 1, 1, 0), (2, 0, 0, 1)):
            _, *answers, _, _ = client.predict("sw", 0, "", NEW, *plan, api_name="/ask")
            reads.append(log.read_text().count(WEIGHTS_READ))
            ref.build(Plan(*plan))
            for got, a in zip(answers, ref.ask_mgsm("sw", 0, source=mgsm_dir, max_new_tokens=NEW), strict=True):
                assert "· vllm ·" in got and a.scored.output.strip() in got, (plan, got, a.scored.output)
                seen.add(a.scored.output)
        assert reads[0] >= 1 and reads[1] == reads[0], f"a new plan started or reloaded an engine: {reads}"
        assert len(seen) >= 3, "the experts and merges must answer differently for this test to mean anything"
    finally:
        app.close()
        ref.close()


def test_family_evaluation_keeps_one_vllm_engine_and_reloads_each_language(engine, vllm_trio, mgsm_dir, tmp_path,
                                                                          monkeypatch):
    """A family of two on vLLM's CPU build, one engine swapped (the plan's ``reload``: sleep mode is for GPUs): the
    module's one engine serves every model of both languages (nothing else starts), each language expert and merge
    reloaded into it, and the table is the transformers engine's, cell for cell."""
    from layerswap.engines import EngineSettings
    from layerswap.evaluation.run import EvalConfig
    from layerswap.models.family import Family
    from layerswap.recipe.recipes import Recipe
    from layerswap.serving.family import evaluate_family
    from layerswap.shipped.demo import perturb

    eng, _ = engine
    second = perturb(vllm_trio["base"], tmp_path / "lang2", scale=0.3, seed=3)
    fam = Family.parse(str(vllm_trio["math"]), [f"sw={vllm_trio['lang']}", f"en={second}"])
    recipes = {c: {"swap": Recipe(plan=Plan(b=1, u=1, tb=0, tu=0))} for c in fam.codes}
    cfg = EvalConfig(langs=list(fam.codes), limit=2, max_new_tokens=NEW, source=str(mgsm_dir))
    running, notes, acquired = VLLMEngine.pooled(), [], []
    real = VLLMEngine.acquire.__func__
    monkeypatch.setattr(VLLMEngine, "acquire", classmethod(lambda cls, *a, **k: acquired.append(a[0]) or
                                                            real(cls, *a, **k)))
    got = evaluate_family(fam, recipes, cfg, EngineSettings(engine="vllm", serving="one"), note=notes.append)
    assert VLLMEngine.pooled() == running and not eng.in_use  # the pooled engine, reused and given back
    assert len(acquired) == 1  # taken once for the family (not once per language)
    assert notes[0].startswith("family plan: reload; A family of 2") and "sleep mode is for GPUs" in notes[0]
    assert set(got.engines.values()) == {"vllm"}
    want = evaluate_family(fam, recipes, cfg, EngineSettings(engine="transformers", device="cpu"))
    cells = lambda rep: sorted((r.model, r.lang, r.index, r.output) for r in rep.results)  # noqa: E731
    assert cells(got) == cells(want) and len(got.results) == 2 * 3 * 2
