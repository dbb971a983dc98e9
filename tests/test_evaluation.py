"""MGSM evaluation (`layerswap.evaluation.run`) on the transformers engine, and `layerswap eval`."""

from __future__ import annotations

import json
import threading

import pytest

from layerswap import UserError
from layerswap.evaluation import mgsm
from layerswap.cli import main as cli
from layerswap.engines import Engine, TransformersEngine
from layerswap.evaluation.run import EvalConfig, build_prompts, evaluate
from tests.helpers import DEMO_MGSM


@pytest.fixture(scope="module")
def math_engine(trio):
    return TransformersEngine.from_pretrained(trio["math"], batch_size=4)


def test_prompts_follow_lm_eval(mgsm_dir):
    ps = build_prompts("sw", EvalConfig(langs=["sw"], source=str(mgsm_dir)))
    assert len(ps) == 250 and ps[7].prompt == mgsm.build_prompt(ps[7].question, mgsm.get_language("sw"))
    eight = build_prompts("en", EvalConfig(langs=["en"], shots=8, limit=3, source=str(mgsm_dir)))
    blocks = [p.prompt.split("\n\n") for p in eight]
    assert all(len(b) == 9 for b in blocks)
    # one seeded sampler per language, shared across questions: same exemplars, reproducible order
    assert sorted(blocks[0][:8]) == sorted(blocks[1][:8]) and blocks[0][:8] != blocks[1][:8]
    again = build_prompts("en", EvalConfig(langs=["en"], shots=8, limit=3, source=str(mgsm_dir)))
    assert [p.prompt for p in again] == [p.prompt for p in eight]
    direct = build_prompts("de", EvalConfig(langs=["de"], mode="direct", limit=1, source=str(mgsm_dir)))
    assert direct[0].prompt.endswith("\nAntwort:")


def test_evaluate_scores_match_per_question_rows(math_engine, mgsm_dir, tmp_path):
    cfg = EvalConfig(langs=["sw", "en"], limit=5, max_new_tokens=12, source=str(mgsm_dir))
    seen = []
    rep = evaluate({"math": math_engine}, cfg, progress=lambda f, d: seen.append(f))
    assert len(rep.results) == 10 and not rep.cancelled and rep.engines == {"math": "transformers"}
    assert seen[0] == 0.0 and seen[-1] == 1.0 and seen == sorted(seen)
    for r in rep.results:
        s = mgsm.score(r.output, r.gold, mgsm.get_language(r.lang))
        assert (r.strict, r.flexible, r.flexible_correct) == (s.strict, s.flexible, s.flexible_correct)
    # outputs equal the engine's own answers to the same prompts
    assert [r.output for r in rep.results[:5]] == math_engine.generate(
        [r.prompt for r in rep.results[:5]], max_new_tokens=12, stop=mgsm.get_language("sw").stop)
    table = {row["language"]: row for row in rep.table("flexible")}
    sw = [r.flexible_correct for r in rep.results if r.lang == "sw"]
    assert table["sw"]["math"] == round(100 * sum(sw) / 5, 1) and table["sw"]["n"] == 5
    assert table["average"]["math"] == round((table["sw"]["math"] + table["en"]["math"]) / 2, 1)
    assert table["max"]["math"] == max(table["sw"]["math"], table["en"]["math"])
    out = rep.write_jsonl(tmp_path / "r.jsonl")
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 10 and rows[0]["lang"] == "sw" and rows[0]["index"] == 0 and rows[0]["shots"] == 0


def test_direct_mode_strict_is_the_whole_answer():
    lang = mgsm.get_language("en")
    s = mgsm.score(" 42", 42, lang, mode="direct")
    assert s.strict == "42" and s.strict_correct
    assert not mgsm.score("42 apples", 42, lang, mode="direct").strict_correct


def test_cancel_keeps_finished_batches(math_engine, mgsm_dir):
    cancel = threading.Event()

    def progress(f, d):
        if f > 0:
            cancel.set()  # a user pressing Stop after the first batch

    cfg = EvalConfig(langs=["sw", "te"], limit=40, max_new_tokens=4, source=str(mgsm_dir))
    rep = evaluate({"a": math_engine, "b": math_engine}, cfg, progress=progress, cancel=cancel)
    assert rep.cancelled and 0 < len(rep.results) < 40
    assert len(rep.results) % 4 == 0  # whole batches of the engine (batch size 4)


def test_cancel_keeps_answers_of_length_sorted_batches(math_engine):
    """The transformers engine batches the shortest prompts first: what is kept is exactly those, in file order."""
    cancel = threading.Event()
    seen = []

    def progress(f, d):
        seen.append(d)
        if f > 0:
            cancel.set()

    cfg = EvalConfig(langs=["xx"], limit=12, max_new_tokens=4, source=str(DEMO_MGSM))
    rep = evaluate({"m": math_engine}, cfg, progress=progress, cancel=cancel)
    prompts = [x.prompt for x in build_prompts("xx", cfg)]
    shortest = sorted(range(12), key=lambda i: len(prompts[i]))[:4]
    assert shortest != [0, 1, 2, 3], "the test means something only if batches are not in file order"
    assert rep.cancelled and [r.index for r in rep.results] == sorted(shortest)
    assert seen[1].startswith("m: xx 4/12 questions, ") and seen[1].endswith("% right so far")
    assert seen[-1] == "cancelled"
    stop = mgsm.get_language("xx", DEMO_MGSM).stop
    assert [r.output for r in rep.results] == math_engine.generate([r.prompt for r in rep.results], max_new_tokens=4,
                                                                   stop=stop)


class OneShotEngine:
    """A third-party engine: answers everything at once and reports it as one batch (or not at all)."""

    name = "echo"

    def __init__(self, report: bool = True):
        self.report = report

    def generate(self, prompts, max_new_tokens=256, stop=None, on_batch=None):
        outs = [f"The answer is {len(p) % 7}" for p in prompts]
        if self.report and on_batch is not None:
            on_batch(list(range(len(prompts))), outs)
        return outs


@pytest.mark.parametrize("report_batches", [True, False])
def test_third_party_engine(report_batches):
    eng = OneShotEngine(report_batches)
    assert isinstance(eng, Engine)
    seen = []
    cfg = EvalConfig(langs=["en", "xx"], limit=3, source=str(DEMO_MGSM))
    rep = evaluate({"echo": eng}, cfg, progress=lambda f, d: seen.append((f, d)))
    assert [(r.lang, r.index) for r in rep.results] == [(c, i) for c in ("en", "xx") for i in range(3)]
    assert all(r.output == f"The answer is {len(r.prompt) % 7}" and r.engine == "echo" for r in rep.results)
    assert seen[0] == (0.0, "starting") and seen[-1] == (1.0, "done")
    right = sum(r.flexible_correct for r in rep.results if r.lang == "en")
    assert (0.5, f"echo: en 3/3 questions, {100 * right / 3:.0f}% right so far") in seen if report_batches \
        else len(seen) == 2


@pytest.mark.parametrize("cfg, msg", [
    (EvalConfig(langs=["sw", "xx"]), "Unknown MGSM language code xx"),
    (EvalConfig(langs=[]), "at least one MGSM language"),
    (EvalConfig(langs=["sw"], shots=9), "shots must be between 0 and 8"),
    (EvalConfig(langs=["sw"], limit=0), "limit must be at least 1"),
])
def test_bad_config(cfg, msg, math_engine, mgsm_dir):
    cfg.source = str(mgsm_dir)
    with pytest.raises(UserError, match=msg):
        evaluate({"m": math_engine}, cfg)


def test_bad_tsv_fails_before_generating(math_engine, tmp_path):
    (tmp_path / "mgsm_sw.tsv").write_text("Swali moja\t3\nline without tab\n", encoding="utf-8")
    cfg = EvalConfig(langs=["sw"], source=str(tmp_path))
    with pytest.raises(UserError, match="line 2: expected 'question<TAB>answer'"):
        evaluate({"m": math_engine}, cfg)
    with pytest.raises(UserError, match="mgsm_te.tsv not found; this folder has: sw"):
        evaluate({"m": math_engine}, EvalConfig(langs=["te"], source=str(tmp_path)))


def test_eval_cli_model(trio, mgsm_dir, tmp_path, capsys):
    out = tmp_path / "res.jsonl"
    rc = cli(["eval", "--model", str(trio["lang"]), "--langs", "sw,te", "--limit", "4", "--shots", "8",
              "--max-new-tokens", "6", "--mgsm-dir", str(mgsm_dir), "--engine", "transformers", "-q", "-o", str(out)])
    table, err = capsys.readouterr()
    assert rc == 0 and "engine: answered by transformers (chosen)" in err and "8-shot" in err
    assert table.startswith("language | n | extraction | lang\n") and "sw | 4 | strict |" in table
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 8 and rows[0]["shots"] == 8 and rows[0]["prompt"].count("Swali:") == 9


def test_eval_cli_merge_of_two_experts(trio, mgsm_dir, tmp_path, capsys):
    rc = cli(["eval", "--math", str(trio["math"]), "--lang", str(trio["lang"]), "--b", "1", "--u", "1",
              "--langs", "bn", "--limit", "2", "--max-new-tokens", "4", "--mgsm-dir", str(mgsm_dir),
              "--engine", "transformers", "-q"])
    out, err = capsys.readouterr()
    assert rc == 0 and "math expert | language expert | merged model" in out and "plan: swap b=1 u=1" in err


@pytest.mark.parametrize("argv, msg", [
    (["--langs", "sw,zz"], "Unknown MGSM language code zz"),
    (["--mgsm-dir", "/nonexistent/mgsm"], "mgsm_sw.tsv not found"),
    (["-o", "/nonexistent/dir/r.jsonl"], "its folder does not exist"),
    (["--chat-template"], "has no chat template"),
])
def test_eval_cli_bad_input(argv, msg, trio, mgsm_dir, capsys):
    base = ["eval", "--model", str(trio["math"]), "--langs", "sw", "--limit", "1", "--engine", "transformers",
            "--mgsm-dir", str(mgsm_dir), "-q"]
    assert cli(base + argv) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1


def test_eval_cli_needs_a_model(capsys):
    assert cli(["eval", "--langs", "sw"]) == 2
    assert "Give --model M, or --math M --lang L" in capsys.readouterr().err
