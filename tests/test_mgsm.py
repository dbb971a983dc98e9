"""MGSM loading (real files), lm-eval prompt format, extraction and scoring."""

from __future__ import annotations

import pytest

from layerswap import UserError
from layerswap.evaluation import mgsm


def test_real_files_load(mgsm_dir):
    total = 0
    for code in mgsm.LANGUAGES:
        items = mgsm.load(code, mgsm_dir)
        assert len(items) == 250
        assert all(isinstance(it.answer, int) for it in items)
        total += len(items)
    assert total == 2750
    assert mgsm.available_languages(mgsm_dir) == sorted(mgsm.LANGUAGES)


def test_comma_answers_parse(mgsm_dir):
    raw = [line.rsplit("\t", 1) for line in (mgsm_dir / "mgsm_en.tsv").read_text(encoding="utf-8").splitlines()]
    with_comma = [(i, a) for i, (_, a) in enumerate(raw) if "," in a]
    assert with_comma, "the English file has answers with thousands separators"
    items = mgsm.load("en", mgsm_dir)
    for i, a in with_comma:
        assert items[i].answer == int(a.replace(",", ""))
    es = mgsm.load("es", mgsm_dir)
    quoted = [it for it in es if '"' in it.question]
    assert quoted and quoted[0].question.count('"') == 2, "double quotes are kept verbatim (no CSV quoting)"
    assert any("'" in it.question for it in items)


def test_same_problems_across_languages(mgsm_dir):
    en, sw = mgsm.load("en", mgsm_dir), mgsm.load("sw", mgsm_dir)
    assert [i.answer for i in en] == [i.answer for i in sw]


def test_native_cot_prompt_is_lm_eval_format(mgsm_dir):
    item = mgsm.load("sw", mgsm_dir)[0]
    p = mgsm.build_prompt(item.question, mgsm.get_language("sw"))
    assert p == f"Swali: {item.question}\nJibu la Hatua kwa Hatua:"
    ja = mgsm.load("ja", mgsm_dir)[0]
    assert mgsm.build_prompt(ja.question, mgsm.get_language("ja")).startswith("問題： ")
    assert mgsm.build_prompt(item.question, mgsm.get_language("sw"), mode="direct").endswith("\nAnswer:")


def test_eight_shot_prompt(mgsm_dir):
    ex = mgsm.load_exemplars("en", mgsm_dir)
    q = mgsm.load("en", mgsm_dir)[5].question
    p = mgsm.build_prompt(q, mgsm.get_language("en"), exemplars=ex, shots=8)
    blocks = p.split("\n\n")
    assert len(blocks) == 9 and blocks[-1] == f"Question: {q}\nStep-by-Step Answer:"
    assert all(b.startswith("Question: ") and "\nStep-by-Step Answer: " in b for b in blocks[:-1])
    assert sorted(blocks[:-1]) == sorted(
        e.question + "\nStep-by-Step Answer: " + e.answer[len("Step-by-Step Answer:") + 1:] for e in ex)


def test_strict_extraction_matches_lm_eval_quirks(mgsm_dir):
    """Exemplar rationales vs each language's strict regex: the counts mgsm_eval.md documents."""
    expected = {"bn": 0, "de": 7, "ja": 5}
    for code in mgsm.LANGUAGES:
        lang = mgsm.get_language(code)
        ex = mgsm.load_exemplars(code, mgsm_dir)
        hits = sum(mgsm.is_correct(mgsm.extract_strict(e.answer, lang), e.answer_number) for e in ex)
        assert hits == expected.get(code, 8), code
        assert all(mgsm.is_correct(mgsm.extract_flexible(e.answer), e.answer_number) for e in ex), code


@pytest.mark.parametrize("text, flexible", [
    ("so 5 + 6 = 11. The answer is 11.", "11."),
    ("Total: $1,250 dollars", "$1,250"),
    ("nothing here", "[invalid]"),
    ("-7 degrees then 3", "3"),
    ("The answer is -4", "-4"),
])
def test_flexible_extract(text, flexible):
    assert mgsm.extract_flexible(text) == flexible


@pytest.mark.parametrize("pred, gold, ok", [
    ("2,125", 2125, True), ("18.", 18, True), ("$18", 18, True), ("-5", 5, True),
    ("18.00", 18, False), ("18 dollars", 18, False), ("[invalid]", 0, False),
])
def test_exact_match_normalisation(pred, gold, ok):
    assert mgsm.is_correct(pred, gold) is ok


def test_strict_first_match_and_score():
    lang = mgsm.get_language("en")
    s = mgsm.score("The answer is 3. Later: The answer is 4.", 3, lang)
    assert s.strict == "3." and s.strict_correct and s.flexible == "4." and not s.flexible_correct


def test_bad_inputs(tmp_path):
    with pytest.raises(UserError, match="Unknown MGSM language 'xx'"):
        mgsm.get_language("xx")
    (tmp_path / "mgsm_en.tsv").write_text("no tab here\n")
    with pytest.raises(UserError, match="line 1: expected 'question<TAB>answer'"):
        mgsm.load("en", tmp_path)
    (tmp_path / "mgsm_de.tsv").write_text("Wie viel?\tzwölf\n")
    with pytest.raises(UserError, match="is not a number"):
        mgsm.load("de", tmp_path)
    with pytest.raises(UserError, match="mgsm_sw.tsv not found; this folder has: de, en"):
        mgsm.load("sw", tmp_path)


def test_extra_languages_json(tmp_path):
    (tmp_path / "languages.json").write_text(
        '{"xx": {"name": "Xish", "question": "Qo:", "answer_cue": "Ans-step:", "direct_cue": "Ans:",'
        ' "strict_regex": "ans is (\\\\-?[0-9\\\\.\\\\,]+)"}}')
    (tmp_path / "mgsm_xx.tsv").write_text("zo 3 ba 4\t7\n")
    lang = mgsm.get_language("xx", tmp_path)
    assert mgsm.load("xx", tmp_path)[0].answer == 7
    assert mgsm.build_prompt("zo 3 ba 4", lang) == "Qo: zo 3 ba 4\nAns-step:"
    assert mgsm.extract_strict("x ans is 7 .", lang) == "7"


def test_offline_hub_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mgsm.hub_reachable.cache_clear()
    mgsm._load.cache_clear()
    monkeypatch.delenv("LAYERSWAP_MGSM_DIR", raising=False)
    try:
        with pytest.raises(UserError, match="point --mgsm-dir"):
            mgsm.load("te")
    finally:
        mgsm.hub_reachable.cache_clear()


def test_one_prompt_function_for_ask_and_evaluation(monkeypatch):
    """`mgsm.prompt_for` gives a set question exactly as the evaluation prompts it (the few-shot exemplars
    lm-eval's shared sampler draws for that question), with its gold answer; free text gets the first draw."""
    from tests.helpers import DEMO_MGSM

    items = mgsm.load("en", DEMO_MGSM)
    for shots, mode in ((0, "native_cot"), (3, "native_cot"), (2, "direct")):
        every = mgsm.prompts("en", shots=shots, mode=mode, source=DEMO_MGSM)
        for i in (0, 4, len(items) - 1):
            p = mgsm.prompt_for("en", index=i, shots=shots, mode=mode, source=DEMO_MGSM)
            assert p == every[i] and p.gold == items[i].answer and p.index == i and p.mode == mode
            assert p.prompt.endswith(mgsm.build_prompt(items[i].question, p.language, mode=mode).split("\n\n")[-1])
    free = mgsm.prompt_for("en", question="  Tom has 3 apples. How many? ", shots=3, source=DEMO_MGSM)
    first = mgsm.prompts("en", limit=1, shots=3, source=DEMO_MGSM)[0]
    assert free.gold is None and free.prompt.split("\n\n")[:3] == first.prompt.split("\n\n")[:3]
    assert free.prompt.endswith("Question: Tom has 3 apples. How many?\nStep-by-Step Answer:")
    # the data folder of $LAYERSWAP_MGSM_DIR defines its own languages for every caller, not only the evaluation
    monkeypatch.setenv("LAYERSWAP_MGSM_DIR", str(DEMO_MGSM))
    assert mgsm.prompt_for("xx", index=0).language.code == "xx"
    assert mgsm.prompt_for("xx", question="free text").language.code == "xx"
    with pytest.raises(UserError, match="question must be a whole number"):
        mgsm.prompt_for("en", index=len(items))
    # the prompt scores in its own mode: strict is the whole output in direct mode
    assert mgsm.prompt_for("en", index=0, mode="direct", source=DEMO_MGSM).score(f" {items[0].answer}").strict_correct
