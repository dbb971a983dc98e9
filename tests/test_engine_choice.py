"""One engine decision for every caller (issue 39): the page, `ask`, `eval` (a trio and `--model`), lm-eval, the lens,
`search` and sweeps all ask `engines.choice.choose_engines`, and do what it answers; the engine flags are declared
once (`EngineSettings.add_arguments`) for the CLI's commands and the app, and reach the workbench's plan."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
import yaml

from layerswap.cli import build_parser, main as cli
from layerswap.core.errors import UserError
from layerswap.engines import choice
from layerswap.engines.choice import ENGINE_FLAGS, EngineChoice, EngineSettings
from layerswap.recipe.plans import Plan
from tests.helpers import DEMO_MGSM

REAL = choice.choose_engines
CPU = EngineSettings(engine="transformers", device="cpu")


class Asked:
    """Stands in for the one decision: records each question (the models' roles, the settings) and answers
    with `answer` (default: the real decision)."""

    def __init__(self):
        self.calls: list[tuple[tuple[str, ...], EngineSettings]] = []
        self.answer = REAL

    def __call__(self, settings, models, **kw):
        self.calls.append((tuple(sorted(models)), settings))
        return self.answer(settings, models, **kw)


@pytest.fixture
def asked(monkeypatch) -> Asked:
    spy = Asked()
    monkeypatch.setattr(choice, "choose_engines", spy)
    return spy


def refuse(settings, models, **kw):
    raise UserError(f"the one decision was asked about {', '.join(sorted(models))}")


def no_answers(settings, models, **kw):
    """The real decision for a trio, with answers turned off by it."""
    c = REAL(settings, models, **kw)
    return replace(c, engine="none", plan=replace(c.plan, arrangement="none", problem="the decision says no."))


def _sweep_file(tmp_path, trio) -> str:
    f = tmp_path / "sweep.yaml"
    f.write_text(yaml.safe_dump({
        "name": "tiny", "experts": {k: str(trio[k]) for k in ("math", "lang", "base")},
        "recipes": [{"name": "b1", "plan": {"b": 1, "u": 1, "tb": 0, "tu": 0}}],
        "test_sets": [{"path": str(DEMO_MGSM), "langs": ["xx"]}], "eval": {"limit": 1, "max_new_tokens": 2},
        "engine": {"engine": "transformers", "device": "cpu"}}))
    return str(f)


def test_every_command_asks_the_one_decision(asked, trio, tmp_path, capsys):
    """Each command's engine (or the lens's device, lm-eval's backend) comes from the one decision: refused there,
    every command stops with its message, and it was asked about the models the command runs."""
    asked.answer = refuse
    m, l, b = (str(trio[k]) for k in ("math", "lang", "base"))
    trio_args = ["--math", m, "--lang", l, "--base", b]
    data = ["--mgsm-dir", str(DEMO_MGSM)]
    commands = {
        "ask": (["ask", *trio_args, "--mgsm-lang", "xx", "--index", "0", *data], "base, lang, math"),
        "eval (a trio)": (["eval", *trio_args, "--langs", "xx", "--limit", "1", *data], "base, lang, math"),
        "eval --model": (["eval", "--model", m, "--langs", "xx", "--limit", "1", *data], "model"),
        "lm-eval": (["lm-eval", m, "--tasks", "anything"], "model"),
        "lens": (["lens", *trio_args, "--mgsm-lang", "xx", "--index", "0", "--models", "math", *data], "model"),
        "search": (["search", *trio_args, "--langs", "xx", *data, "--budget", "1", "-o", str(tmp_path / "s.jsonl"),
                    "-q"], "base, lang, math"),
        "sweep": (["sweep", _sweep_file(tmp_path, trio), "-o", str(tmp_path / "r.jsonl"), "-q"], "base, lang, math"),
    }
    for name, (argv, models) in commands.items():
        assert cli(argv) == 2, name
        assert f"the one decision was asked about {models}" in capsys.readouterr().err, name
    assert len(asked.calls) == len(commands)


def test_the_page_asks_it_through_its_workbench(asked, trio):
    """The app's models are checked by a workbench made from the app's engine settings, which asks the decision."""
    from layerswap.ui.context import AppDefaults, Context

    asked.answer = no_answers
    ctx = Context(AppDefaults(math=str(trio["math"]), lang=str(trio["lang"]), base=str(trio["base"]), engine=CPU))
    try:
        wb = ctx.shared.workbench(ctx.key)
        assert wb.engine_plan.problem == "the decision says no." and not wb.engine_plan.fits
        assert asked.calls == [(("base", "lang", "math"), wb.settings)] and wb.settings.engine == "transformers"
    finally:
        ctx.shared.close()


def test_one_model_follows_the_decision(asked, trio):
    """`eval --model`'s engine and lm-eval's backend are what the decision says, whatever was asked."""
    from layerswap.engines import TransformersEngine, open_engine
    from layerswap.models.checkpoints import Checkpoint
    from layerswap.sweeps.lmeval import backend_for

    asked.answer = lambda s, m, **kw: EngineChoice("transformers", "cpu", "cpu", "the decision chose it")
    eng, note = open_engine(trio["math"], engine="vllm")
    assert isinstance(eng, TransformersEngine) and note == "answered by transformers: the decision chose it"
    assert asked.calls[-1][1].engine == "vllm"
    ck = Checkpoint.open(trio["math"])
    assert backend_for(ck, EngineSettings(engine="vllm")) == ("hf", "cpu")
    asked.answer = lambda s, m, **kw: EngineChoice("vllm", "cpu", "cpu", "vLLM here")
    assert backend_for(ck, CPU) == ("vllm", "cpu")
    asked.answer = lambda s, m, **kw: EngineChoice("none", "cpu", "cpu", "vLLM is not installed")
    with pytest.raises(UserError, match="vLLM is not installed"):
        backend_for(ck, EngineSettings(engine="vllm"))


def test_lm_eval_speaks_the_engine_vocabulary(asked, trio, capsys):
    """lm-eval's --engine is the shared flag (its default transformers: lm-eval's hf); --backend hf|vllm is its
    alias; each reaches the one decision in the shared words."""
    asked.answer = refuse
    for flags, engine in (([], "transformers"), (["--engine", "auto"], "auto"), (["--backend", "vllm"], "vllm"),
                          (["--backend", "hf"], "transformers")):
        assert cli(["lm-eval", str(trio["math"]), "--tasks", "t", *flags]) == 2
        assert asked.calls[-1][1].engine == engine, flags
    capsys.readouterr()


def test_the_lens_runs_where_the_decision_says(asked, trio):
    """`run_lens` asks the decision (for transformers models) and runs on its analysis device: asked for cuda on
    this CPU machine, it runs on the CPU the decision answers."""
    from layerswap.analysis.lens import LensConfig, run_lens

    asked.answer = lambda s, m, **kw: EngineChoice("transformers", "cuda", "cpu", "the GPU is busy")
    cfg = LensConfig("xx", index=0, batch=2, source=str(DEMO_MGSM))
    res = run_lens(trio["math"], trio["lang"], Plan(b=1, u=1, tb=0, tu=0), config=cfg, device="cuda",
                   forward="stream", roles=("math",))
    assert res.models["math"].streamed and asked.calls == [(("model",), EngineSettings(engine="transformers",
                                                                                        device="cuda"))]


def test_the_page_lens_honours_the_plans_analysis_device(trio):
    """Beside a workbench's engines the lens streams on the plan's analysis device: a workbench on a GPU whose plan
    leaves the analysis no headroom there (`analysis_device` cpu) runs its lens on the CPU."""
    from layerswap.analysis.lens import LensConfig, lens_workbench
    from layerswap.recipe.recipes import Recipe
    from layerswap.serving.workbench import Workbench

    wb = Workbench.from_settings(CPU)
    try:
        wb.check(str(trio["math"]), str(trio["lang"]), str(trio["base"]))
        wb.device = "cuda"  # as on a GPU; the plan keeps the analysis and the lens on the CPU
        wb.engine_plan = replace(wb.engine_plan, analysis_device="cpu")
        assert wb.analysis_device == "cpu"
        res = lens_workbench(wb, LensConfig("xx", index=0, batch=2, source=str(DEMO_MGSM)),
                             recipe=Recipe(plan=Plan(b=1, u=1, tb=0, tu=0)))
        assert all(m.streamed for m in res.models.values()) and set(res.models) == {"math", "lang", "merged", "base"}
    finally:
        wb.close()


# ---- the engine flags, declared once ------------------------------------------------------------------------------

def _actions(p: argparse.ArgumentParser) -> dict[str, tuple]:
    return {a.option_strings[0]: (a.dest, a.default, a.help, a.choices, a.type, a.metavar)
            for a in p._actions if a.option_strings}


def _subparser(cmd: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[cmd]


def test_the_app_and_the_cli_take_the_same_engine_flags(monkeypatch):
    """`python app.py`, `layerswap app` and the commands that answer declare every engine flag alike (flag, default,
    help, choices, type: from `ENGINE_FLAGS`); an environment variable sets the default for all of them."""
    from layerswap.ui import launch

    monkeypatch.setenv("LAYERSWAP_SERVING", "one")
    app = argparse.ArgumentParser()
    launch.add_arguments(app)
    parsers = {"app.py": _actions(app), **{cmd: _actions(_subparser(cmd)) for cmd in ("app", "ask", "eval", "sweep",
                                                                                       "search")}}
    for f in ENGINE_FLAGS:
        seen = {name: acts.get(f.flag) for name, acts in parsers.items()}
        assert None not in seen.values() and len(set(seen.values())) == 1, (f.flag, seen)
    assert parsers["app.py"]["--serving"][1] == "one" and parsers["app.py"]["--device"][1] == "auto"
    assert parsers["ask"]["--engine"][3] == choice.ENGINE_CHOICES


def test_an_app_flag_reaches_the_workbench_plan(monkeypatch, trio):
    """The app's --engine/--serving/--max-model-len/--tensor-parallel-size become its workbench's `EngineSettings`
    and its engine plan (on a played GPU, so nothing starts)."""
    from layerswap.ui import launch
    from layerswap.ui.context import Context

    monkeypatch.setenv("LAYERSWAP_HARDWARE", "a100-large")
    p = argparse.ArgumentParser()
    launch.add_arguments(p)
    args = p.parse_args(["--math", str(trio["math"]), "--lang", str(trio["lang"]), "--engine", "vllm", "--serving",
                         "one", "--max-model-len", "512", "--device", "cpu"])
    defaults = launch.app_defaults(args)
    assert defaults.engine == EngineSettings(engine="vllm", device="cpu", serving="one", max_model_len=512)
    ctx = Context(defaults)
    try:
        plan = ctx.shared.workbench(ctx.key).engine_plan
        assert plan.played and plan.arrangement == "one_vllm_swapped" and plan.settings.max_model_len == 512
    finally:
        ctx.shared.close()
    monkeypatch.delenv("LAYERSWAP_ENGINE")  # (the tests' own default)
    cli_args = build_parser().parse_args(["ask", "--math", "m", "--lang", "l", "--serving", "two",
                                          "--tensor-parallel-size", "2"])
    assert EngineSettings.from_args(cli_args, None) == EngineSettings(serving="two", tensor_parallel_size=2)
