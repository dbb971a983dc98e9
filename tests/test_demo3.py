"""The shipped family organism (assets/demo3: one base, one math expert, a language expert per cipher): its files
agree with each other and with build_info.json, its preset opens it, and each language's test set is found by its
code. Fast: headers, hashes and text files only (no model runs)."""

from __future__ import annotations

import json
import sys
from math import prod as math_prod
from pathlib import Path

import pytest

from layerswap import Checkpoint, check_compatible
from layerswap.core.errors import UserError
from layerswap.engines.base import load_tokenizer
from layerswap.evaluation import mgsm
from layerswap.merge.publish import sha256
from layerswap.models.presets import MAX_FAMILY, assets_path, presets
from layerswap.shipped import organisms

REPO = Path(__file__).resolve().parent.parent
DEMO3 = REPO / "assets" / "demo3"
INFO = json.loads((DEMO3 / "build_info.json").read_text()) if (DEMO3 / "build_info.json").is_file() else {}
shipped = pytest.mark.skipif(not INFO, reason="assets/demo3 is not shipped")
CODES = sorted(INFO.get("languages", {}))


@shipped
def test_family_has_three_languages_and_a_member_for_each():
    assert len(CODES) >= 3 and all(c != "en" for c in CODES)
    members = {"base", "math", *(f"lang_{c}" for c in CODES)}
    assert {p.name for p in DEMO3.iterdir() if (p / "config.json").is_file()} == members
    assert set(INFO["sha256"]) == members


@shipped
def test_members_open_from_one_base_with_one_shape():
    base = Checkpoint.open(DEMO3 / "base")
    math = Checkpoint.open(DEMO3 / "math")
    shapes = {n: t.shape for n, t in base.tensors.items()}
    for code in CODES:
        lang = Checkpoint.open(DEMO3 / f"lang_{code}")
        rep = check_compatible(math, lang, base)
        assert rep.ok, (code, rep.summary())
        assert {n: t.shape for n, t in lang.tensors.items()} == shapes
    assert {n: t.shape for n, t in math.tensors.items()} == shapes
    vocab = {json.dumps(load_tokenizer(DEMO3 / m).get_vocab(), sort_keys=True) for m in INFO["sha256"]}
    assert len(vocab) == 1  # one tokenizer for the whole family
    assert INFO["params"] == sum(math_prod(t.shape) for t in base.tensors.values())


@shipped
def test_build_info_hashes_match_the_shipped_files():
    for member, digest in INFO["sha256"].items():
        assert sha256(DEMO3 / member / "model.safetensors") == digest, member
    assert INFO["seconds"]["total"] > 0 and INFO["threads"] == 1 and "seed" in INFO


@shipped
def test_each_language_has_its_own_held_out_test_set():
    test, dev = DEMO3 / "mgsm", DEMO3 / "mgsm" / "dev"
    en = mgsm.load("en", test)
    assert set(mgsm.available_languages(test)) == {"en", *CODES} == set(mgsm.available_languages(dev))
    questions = set()
    for code in CODES:
        items = mgsm.load(code, test)
        assert len(items) >= 300 and [i.answer for i in items] == [i.answer for i in en]  # parallel, as MGSM is
        held = {i.question for i in mgsm.load(code, dev)}
        assert len(held) >= 200 and not held & {i.question for i in items}  # dev is not test
        assert len(mgsm.load_exemplars(code, test)) >= 2
        assert mgsm.languages(test)[code].name == INFO["languages"][code]
        questions |= {items[0].question}
    assert len(questions) == len(CODES)  # each language words the same problem its own way


@shipped
def test_prompts_of_every_language_tokenize_without_unknown_words():
    tok = load_tokenizer(DEMO3 / "math")
    for src in (DEMO3 / "mgsm", DEMO3 / "mgsm" / "dev"):
        langs = mgsm.languages(src)
        for code in mgsm.available_languages(src):
            for it in mgsm.load(code, src)[:50]:
                ids = tok(mgsm.build_prompt(it.question, langs[code]))["input_ids"]
                assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids, (code, it.index)


@shipped
def test_each_language_test_set_is_found_by_its_code():
    for code in CODES:
        ref = f"assets:demo3/lang_{code}"
        assert organisms.language_of(ref) == code
        assert organisms.test_set_for(code, "assets:demo3/math", ref) == assets_path("assets:demo3/mgsm")
    assert organisms.test_set_for("yy", "assets:demo3/math") is None  # another organism's language
    assert organisms.language_of("assets:demo3/math") is None and organisms.language_of("assets:demo2/lang") is None
    assert organisms.test_set_for("yy", "assets:demo3/math", "assets:demo2/lang") == assets_path("assets:demo2/mgsm")


@shipped
def test_the_preset_opens_the_family():
    p = presets()["demo3"]
    assert (p.base, p.math) == ("assets:demo3/base", "assets:demo3/math")
    assert dict(p.langs) == {c: f"assets:demo3/lang_{c}" for c in CODES} and p.lang == p.langs[0][1]
    for ref in (p.base, p.math, *dict(p.langs).values()):
        assert (assets_path(ref) / "config.json").is_file()
    assert organisms.test_set(p.math, p.lang) == assets_path("assets:demo3/mgsm")


@shipped
def test_gates_are_recorded_as_measured():
    g = INFO["gates"]
    dev, verdicts = g["dev_flexible_and_strict"], g["verdicts"]
    for code in CODES:  # each verdict is what its numbers say, not a flag set by hand
        v = verdicts[f"swap_{code}_beats_math_in_{code}"]
        assert v["swap"] == dev[f"swap {code}"][f"{code} flexible"] and v["math"] == dev["math"][f"{code} flexible"]
        assert v["passed"] == (v["swap"] - v["math"] >= INFO["recipe"]["swap_margin"])
        s = verdicts[f"lang_{code}_speaks_{code}"]
        assert s["lang"] == g["speaks"][f"lang_{code}"][code]


@pytest.mark.parametrize("langs,msg", [("[assets:demo3/lang_qa]", "must map each MGSM code"),
                                       ("{qa: 3}", "must map each MGSM code"),
                                       ("{" + ", ".join(f"c{i}: x/y{i}" for i in range(MAX_FAMILY + 1)) + "}",
                                        f"at most {MAX_FAMILY}")])
def test_a_preset_family_that_is_not_a_small_mapping_is_refused(tmp_path, langs, msg):
    f = tmp_path / "presets.yaml"
    f.write_text(f"presets:\n  fam:\n    label: F\n    math: org/math\n    lang: org/lang\n    langs: {langs}\n")
    with pytest.raises(UserError, match=msg):
        presets(f)


@shipped
def test_a_preset_family_with_a_missing_shipped_member_is_left_out(tmp_path):
    f = tmp_path / "presets.yaml"
    f.write_text("presets:\n  fam:\n    label: F\n    base: assets:demo3/base\n    math: assets:demo3/math\n"
                 "    lang: assets:demo3/lang_qa\n    langs: {qa: assets:demo3/lang_qa, zz: assets:demo3/lang_zz}\n")
    assert "fam" not in presets(f)


sys.path.insert(0, str(REPO / "scripts"))


@shipped
def test_build_script_languages_are_the_shipped_ones():
    import demo_world3

    assert INFO["languages"] == {c: demo_world3.SOUNDS[c][0] for c in demo_world3.CODES}
    d = json.loads((DEMO3 / "dictionary.json").read_text())
    assert d == demo_world3.LEXICONS  # the lexicons do not depend on the build's seed


@shipped
def test_card_is_written_from_build_info_and_its_family_table():
    """The card is what scripts/demo3_card.py writes from build_info.json and family_table.json (what `layerswap
    eval` over the family wrote), and the claims its words make hold in those numbers."""
    import json

    import demo3_card

    assert (DEMO3 / "README.md").read_text(encoding="utf-8") == demo3_card.card(DEMO3), \
        "assets/demo3/README.md is stale: run scripts/demo3_card.py"
    t = json.loads((DEMO3 / "family_table.json").read_text())
    assert t["family"]["languages"] == {c: f"assets:demo3/lang_{c}" for c in ("qa", "qb", "qc")}
    for lang, row in t["results"].items():
        assert {m: row[m]["n"] for m in row} == {m: 500 for m in t["models"]}, lang  # n = 500 held out, every model
        others = [row[m]["interval"][1] for m in row if m not in ("swap", "ta")]
        assert row["swap"]["interval"][0] > max(others), lang  # above every other model's interval
        assert row["ta"]["correct"] == row["swap"]["correct"], lang


@shipped
def test_task_arithmetic_is_the_swap_here_because_no_tensor_changes_in_both_experts():
    """The card's explanation of ta = swap, recomputed: no tensor of the base is changed by the math expert and by a
    language expert, so base + Δmath + Δlang is the b=2 u=1 swap up to float rounding."""
    from safetensors.torch import load_file

    from layerswap import Plan, Recipe, merge_in_memory

    base, math = (load_file(DEMO3 / m / "model.safetensors") for m in ("base", "math"))
    for code in ("qa", "qb", "qc"):
        lang = load_file(DEMO3 / f"lang_{code}" / "model.safetensors")
        assert not [k for k in base if (math[k] != base[k]).any() and (lang[k] != base[k]).any()], code
        swap = merge_in_memory(math, lang, 8, Recipe(plan=Plan(b=2, u=1, tb=0, tu=0)), base=base.__getitem__)
        ta = merge_in_memory(math, lang, 8, Recipe.from_values(method="task_arithmetic"), base=base.__getitem__)
        assert max((swap[k] - ta[k]).abs().max().item() for k in swap) < 1e-6, code


@pytest.mark.slow
@shipped
def test_rebuild_gives_the_same_weights_and_gates(tmp_path):
    """The family rebuilt from scratch (about 35 minutes on 2 shared cores): the same weights bit for bit."""
    import os
    import subprocess

    threads = str(INFO["threads"])
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_demo3.py"), "--out", str(tmp_path / "demo3"),
                    "--seed", str(INFO["seed"]), "--threads", threads], check=True,
                   env=dict(os.environ, OMP_NUM_THREADS=threads))
    rebuilt = json.loads((tmp_path / "demo3" / "build_info.json").read_text())
    assert rebuilt["recipe"] == INFO["recipe"] and rebuilt["sha256"] == INFO["sha256"]
    assert rebuilt["gates"]["verdicts"] == INFO["gates"]["verdicts"]
