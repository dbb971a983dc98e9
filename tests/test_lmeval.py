"""lm-evaluation-harness on an exported merge: a local task on a data file written here, joined into the sweep table."""

from __future__ import annotations

import json

import pytest
import yaml

from layerswap import Plan, Recipe, UserError
from layerswap.cli import main as cli
from layerswap.sweeps import load_results, run_sweep
from layerswap.sweeps.report import results_table
from tests.helpers import DEMO_MGSM

DOCS = [("one plus one is", ["two", "seven"], 0), ("the sky is", ["green", "blue"], 1),
        ("two plus two is", ["four", "nine"], 0), ("a cat says", ["woof", "meow"], 1),
        ("ice is", ["cold", "hot"], 0), ("the sun is", ["dark", "bright"], 1)]


@pytest.fixture()
def local_task(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the task's data is a local file: no Hub look-ups
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install lm-eval")
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(yaml.safe_dump({
        "task": "tiny_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}],
    }))
    return tasks


def test_lm_eval_on_an_exported_merge_lands_in_the_sweep_table(trio, tmp_path, local_task, capsys):
    from layerswap.sweeps.lmeval import LmEvalConfig, evaluate_model

    recipe = Recipe(plan=Plan(b=1, u=1, tb=1, tu=1))
    rfile = tmp_path / "recipe.yaml"
    recipe.dump(rfile)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "experts": {"math": str(trio["math"]), "lang": str(trio["lang"]), "base": str(trio["base"])},
        "recipes": [{"name": "recipe", **recipe.to_dict()}], "include_experts": False,
        "test_sets": [{"path": str(DEMO_MGSM), "langs": ["xx"]}], "eval": {"limit": 2, "max_new_tokens": 4},
        "engine": {"engine": "transformers", "device": "cpu"}}))
    results = tmp_path / "r.jsonl"
    run_sweep(sweep, results)
    rc = cli(["lm-eval", str(rfile), "--math", str(trio["math"]), "--lang", str(trio["lang"]), "--base",
              str(trio["base"]), "--tasks", "tiny_mc", "--include-path", str(local_task), "--device", "cpu",
              "--keep", str(tmp_path / "merged"), "--sweep-results", str(results), "-o", str(tmp_path / "m.json")])
    assert rc == 0, capsys.readouterr().err
    metrics = json.loads((tmp_path / "m.json").read_text())
    acc = metrics["tiny_mc"]["acc"]
    assert round(acc * len(DOCS)) == pytest.approx(acc * len(DOCS))  # a count of documents
    # the numbers are lm-eval's on the exported merge itself
    again = evaluate_model(tmp_path / "merged", LmEvalConfig(tasks=["tiny_mc"], include_path=str(local_task)))
    assert again["tiny_mc"]["acc"] == acc
    rows = results_table(load_results(results))
    assert len(rows) == 1 and rows[0]["recipe"] == "recipe" and "xx" in rows[0]
    assert rows[0]["tiny_mc acc"] == round(acc, 4)


def test_lm_eval_refusals(tmp_path, trio, local_task, capsys):
    assert cli(["lm-eval", str(trio["math"]), "--tasks", "no_such_task", "--include-path", str(local_task)]) == 2
    assert "does not know task no_such_task" in capsys.readouterr().err
    rfile = tmp_path / "r.yaml"
    Recipe(plan=Plan(b=1, u=1)).dump(rfile)
    assert cli(["lm-eval", str(rfile), "--tasks", "tiny_mc"]) == 2
    assert "is a recipe: give --math and --lang" in capsys.readouterr().err
    with pytest.raises(UserError, match="at least one lm-eval task"):
        from layerswap.sweeps.lmeval import LmEvalConfig

        LmEvalConfig().validate()
