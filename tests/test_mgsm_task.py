"""MGSM as one task object (issue 39): its modes, shot range and metrics live in `mgsm.TASK`, and the CLI's flags,
the page's controls, sweep files, search, the lens and the card ask it (a different task changes every one)."""

from __future__ import annotations

import argparse

import pytest
import yaml

from layerswap.analysis.lens.inputs import LensConfig
from layerswap.cli import build_parser
from layerswap.core.errors import UserError
from layerswap.evaluation import mgsm
from layerswap.evaluation.run import EvalConfig
from layerswap.merge.card import _evaluation
from layerswap.search import SearchConfig
from layerswap.sweeps import load_spec
from tests.helpers import DEMO_MGSM

OTHER = mgsm.Task(modes=(("direct", "answer only"),), mode="direct", max_shots=3,
                  metrics=(("strict", "the cue's number"), ("flexible", "the last number")))


def _flags(parser: argparse.ArgumentParser) -> dict[str, dict[str, argparse.Action]]:
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {a.dest: a for a in sp._actions} for name, sp in subs.choices.items()}


def test_the_defaults_are_the_tasks():
    t = mgsm.TASK
    assert t.mode_names == ("native_cot", "direct") and list(t.shot_range) == list(range(9))
    assert t.metric_names == ("flexible", "strict")
    for cfg in (EvalConfig(), SearchConfig(langs=["sw"]), LensConfig(language="sw")):
        assert cfg.mode == t.mode
    assert EvalConfig().shots == SearchConfig(langs=["sw"]).shots == t.shots
    flags = _flags(build_parser())
    for cmd in ("eval", "ask", "sweep", "search"):
        assert flags[cmd]["shots"].choices == list(t.shot_range) and flags[cmd]["shots"].default == t.shots, cmd
    for cmd in ("eval", "sweep", "search", "lens"):
        assert tuple(flags[cmd]["mode"].choices) == t.mode_names and flags[cmd]["mode"].default == t.mode, cmd


def test_every_consumer_asks_the_task(monkeypatch, tmp_path):
    monkeypatch.setattr(mgsm, "TASK", OTHER)
    flags = _flags(build_parser())  # the CLI's flags
    for cmd in ("eval", "ask", "sweep", "search"):
        assert flags[cmd]["shots"].choices == [0, 1, 2, 3], cmd
    for cmd in ("eval", "sweep", "search", "lens"):
        assert tuple(flags[cmd]["mode"].choices) == ("direct",) and flags[cmd]["mode"].default == "direct", cmd
    pytest.importorskip("gradio")
    from layerswap.ui.tabs.evaluate import protocol

    assert protocol() == {"shots": {"choices": [0, 3], "value": 0},  # the page's controls
                          "mode": {"choices": [("answer only", "direct")], "value": "direct"}}
    with pytest.raises(UserError, match="shots must be between 0 and 3"):
        EvalConfig(langs=["en"], shots=4, mode="direct", source=str(DEMO_MGSM)).validate()
    with pytest.raises(UserError, match="Unknown MGSM mode 'native_cot'; use direct"):
        LensConfig(language="xx", index=0, mode="native_cot").validate()
    with pytest.raises(UserError, match="Unknown MGSM mode"):
        mgsm.prompt_for("en", question="1 + 1?", source=str(DEMO_MGSM), mode="native_cot")
    f = tmp_path / "s.yaml"  # a sweep file's eval settings
    f.write_text(yaml.safe_dump({"experts": {"math": "assets:demo/math", "lang": "assets:demo/lang"},
                                 "recipes": [{"name": "soup", "method": "soup"}],
                                 "test_sets": [{"path": str(DEMO_MGSM), "langs": ["en"]}],
                                 "eval": {"shots": 8, "mode": "direct"}}))
    with pytest.raises(UserError, match="shots must be between 0 and 3"):
        load_spec(f)
    ev = {"limit": 1, "engines": {}, "layerswap_version": "0", "date": "today", "task": "mgsm_direct", "shots": 0,
          "max_new_tokens": 4, "data": "x", "cancelled": False, "models": ["m"],
          "accuracy": {"strict": [{"language": "en", "n": 1, "m": 100.0}], "flexible": []}}
    card = _evaluation({"evaluation": ev})  # the card's tables: the task's metrics, in its order, with its labels
    assert card.index("the cue's number") < card.index("the last number")
