"""The lens end to end: token classes by their rule, the numbers against an independent computation, JSON, bounds,
progress and Stop, the figures, the CLI, the page's entry point, and the demo organism's mechanism."""

from __future__ import annotations

import json
import threading
import unicodedata

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerswap import Plan, UserError
from layerswap.evaluation import mgsm
from layerswap.shipped.demo import build_tokenizer, recommended_plan
from layerswap.analysis.lens import CLASSES, LensConfig, lens_curves, lens_grid, lens_workbench, run_lens, write_report
from layerswap.analysis.lens.inputs import MAX_BATCH, prepare
from tests.helpers import DEMO, DEMO_MGSM, cli_in_process, run_cli

DEMO_MODELS = {r: DEMO / r for r in ("base", "math", "lang")}


# ---- token classes ------------------------------------------------------------------------------------

def test_latin_classes_come_from_the_mgsm_text():
    tok = AutoTokenizer.from_pretrained(DEMO / "math")
    prep = prepare(LensConfig("xx", index=0, batch=2, source=DEMO_MGSM), tok, len(tok))
    c = prep.classes
    of = lambda w: c.of(tok.convert_tokens_to_ids(w))  # noqa: E731
    assert of("▁tenu") == of("▁Danu") == of("▁ki") == "target"  # Kovani words; Danu ki: its answer phrase
    assert of("▁has") == of("▁The") == of("▁answer") == "english"  # The answer is: from the English exemplars
    assert of("▁18") == "digits"
    assert of("▁Raj") == of(".") == "other"  # names and punctuation occur in both languages
    assert c.of(tok.bos_token_id) == "other"
    assert "Latin script" in c.rule and "digits" in c.rule


def test_non_latin_classes_come_from_the_script(tmp_path):
    en = ["Ana has 3 cups. How many cups does Ana have?\t3", "Raj has 12 eggs. He eats 2.\t10"]
    bn = ["আনার ৩টি কাপ আছে। আনার কতগুলি কাপ আছে?\t3", "রাজের ১২টি ডিম আছে। সে ২টি খায়।\t10"]
    (tmp_path / "mgsm_en.tsv").write_text("\n".join(en), encoding="utf-8")
    (tmp_path / "mgsm_bn.tsv").write_text("\n".join(bn), encoding="utf-8")
    tok = build_tokenizer(corpus="\n".join(en + bn) * 3 + " ১২ 12", vocab_size=400)
    prep = prepare(LensConfig("bn", index=1, batch=2, source=tmp_path), tok, len(tok) + 5)
    c = prep.classes
    texts = c.texts
    bengali = [i for i, t in enumerate(texts) if any(ch.isalpha() for ch in t)
               and all("BENGALI" in unicodedata.name(ch, "") for ch in t if ch.isalpha())]
    assert bengali and all(c.of(i) == "target" for i in bengali)
    latin = [i for i, t in enumerate(texts) if t.strip().isascii() and t.strip().isalpha()]
    assert latin and all(c.of(i) == "english" for i in latin)
    assert all(c.of(i) == "digits" for i, t in enumerate(texts) if t.strip() in ("12", "১২", "3", "৩"))
    assert len(c.codes) == len(tok) + 5 and c.of(len(tok) + 2) == "other"  # ids the tokenizer lacks
    assert "BENGALI" in c.rule


# ---- the numbers, against an independent computation ------------------------------------------------

def _independent(model_dir, prompts: list[str], focus: int, twin: int, cka_rows: tuple[list[int], list[int]],
                 codes: np.ndarray):
    """Per layer: top-5 ids/probs, class masses, cosine and CKA, from plain transformers forwards of each prompt
    alone (hidden_states, the model's own norm and lm_head; the last state read before the final norm)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    special = set(tok.all_special_ids)
    pooled, last_logits = [], None
    for k, p in enumerate(prompts):
        ids = tok(p)["input_ids"]
        seen = {}
        h = model.model.norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
            states = [s[0] for s in out.hidden_states[:-1]] + [seen["x"][0]]
            keep = [j for j, t in enumerate(ids) if t not in special]
            pooled.append(np.stack([s[keep].double().mean(0).numpy() for s in states]))
            if k == focus:
                last_logits = [model.lm_head(model.model.norm(s[-1])) for s in states[:-1]] + [out.logits[0, -1]]
        h.remove()
    rows = []
    for i, lg in enumerate(last_logits):
        p = torch.softmax(lg.double(), -1).numpy()
        top = np.argsort(-p)[:5]
        x, y = np.stack([pooled[r][i] for r in cka_rows[0]]), np.stack([pooled[r][i] for r in cka_rows[1]])
        n = len(x)
        H = np.eye(n) - np.ones((n, n)) / n
        K, Lm = x @ x.T, y @ y.T
        hsic = lambda a, b: np.trace(a @ H @ b @ H)  # noqa: E731
        a, b = pooled[focus][i], pooled[twin][i]
        rows.append({"top": top.tolist(), "p": p[top].tolist(),
                     "mass": [p[codes[: len(p)] == c].sum() for c in range(len(CLASSES))],
                     "cos": a @ b / np.linalg.norm(a) / np.linalg.norm(b),
                     "cka": hsic(K, Lm) / np.sqrt(hsic(K, K) * hsic(Lm, Lm))})
    return rows


@pytest.fixture(scope="module")
def tiny_lens(trio):
    cfg = LensConfig("xx", index=5, batch=6, source=DEMO_MGSM, answer_tokens=3)
    plan = Plan(b=2, u=1, tb=1, tu=0)
    return run_lens(trio["math"], trio["lang"], plan, base=trio["base"], config=cfg, device="cpu", forward="stream")


@pytest.fixture(scope="module")
def demo_lens():
    """The organism (its tokenizer adds BOS, which pooling must skip), streamed."""
    cfg = LensConfig("xx", index=5, batch=6, source=DEMO_MGSM)
    return run_lens(DEMO_MODELS["math"], DEMO_MODELS["lang"], recommended_plan(), base=DEMO_MODELS["base"],
                    config=cfg, forward="stream")


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_numbers_match_a_plain_transformers_forward(which, trio, tiny_lens, demo_lens):
    res, dirs = (tiny_lens, trio) if which == "tiny" else (demo_lens, DEMO_MODELS)
    tok = AutoTokenizer.from_pretrained(dirs["math"])
    lang, en = mgsm.get_language("xx", DEMO_MGSM), mgsm.get_language("en", DEMO_MGSM)
    qs, qe = mgsm.load("xx", DEMO_MGSM), mgsm.load("en", DEMO_MGSM)
    idx = list(range(5, 11))
    prompts = [mgsm.build_prompt(qs[i].question, lang) for i in idx] + [mgsm.build_prompt(qe[i].question, en) for i in idx]
    assert res.prompt == prompts[0] and res.twin == prompts[6] and res.batch_indices == idx
    codes = prepare(LensConfig("xx", index=5, batch=6, source=DEMO_MGSM), tok, len(tok)).classes.codes
    for role in ("math", "lang", "base"):
        ref = _independent(dirs[role], prompts, 0, 6, (list(range(6)), list(range(6, 12))), codes)
        got = res.models[role].layers
        assert len(got) == len(ref) == res.num_layers + 1
        for g, r in zip(got, ref):
            assert g.top_ids[0] == r["top"][0]
            assert np.allclose([p for _, p in g.top], r["p"], atol=1e-5)
            assert np.allclose([g.p_target, g.p_english, g.p_digits], r["mass"][:3], atol=1e-5)
            assert g.alignment == pytest.approx(r["cos"], abs=1e-5)
            assert g.cka == pytest.approx(r["cka"], abs=1e-4)


def test_answer_positions_follow_the_models_own_greedy_answer(trio, tiny_lens):
    model = AutoModelForCausalLM.from_pretrained(trio["math"]).eval()
    tok = AutoTokenizer.from_pretrained(trio["math"])
    ids = tok(tiny_lens.prompt, return_tensors="pt")
    gen = model.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)[0, ids["input_ids"].shape[1]:]
    ans = tiny_lens.models["math"].answer
    assert len(ans.positions) == len(gen)
    assert [col[-1].top_ids[0] for col in ans.positions] == gen.tolist()  # the last layer's top token is the answer
    assert ans.inputs[0] == tok.decode([tok(tiny_lens.prompt)["input_ids"][-1]])
    assert ans.positions[0][3].p_target == tiny_lens.models["math"].layers[3].p_target


def test_json_has_exactly_the_issues_schema(tiny_lens, tmp_path):
    data = json.loads(tiny_lens.write_json(tmp_path / "l.json").read_text())
    assert set(data) == {"prompt", "language", "models"} and data["language"] == "xx"
    assert set(data["models"]) == {"math", "lang", "merged", "base"}
    for m in data["models"].values():
        assert set(m) == {"layers", "answer"}  # answer: only because answers were lensed
        assert [x["layer"] for x in m["layers"]] == list(range(7))
        for x in m["layers"]:
            assert set(x) == {"layer", "top", "p_target", "p_english", "p_digits", "alignment", "cka"}
            assert len(x["top"]) == 5 and all(isinstance(t, str) and 0 <= p <= 1 for t, p in x["top"])
    assert set(data["models"]["math"]["answer"]["positions"][0]) == {"token", "layers"}


def test_free_text_with_and_without_a_twin(trio):
    q, twin = "Raj tenu 5 ovu. Kako mnogo ovu du Raj teni sada?", "Raj has 5 eggs. How many eggs does Raj have now?"
    both = run_lens(trio["math"], trio["lang"], Plan(b=1, u=1, tb=0, tu=0), roles=("math",), forward="stream",
                    config=LensConfig("xx", question=q, twin=twin, batch=3, source=DEMO_MGSM))
    alone = run_lens(trio["math"], trio["lang"], Plan(b=1, u=1, tb=0, tu=0), roles=("math",), forward="stream",
                     config=LensConfig("xx", question=q, batch=3, source=DEMO_MGSM))
    assert q in both.prompt and twin in both.twin and both.index is None and both.batch_indices == [0, 1, 2]
    a, b = both.models["math"].layers, alone.models["math"].layers
    assert all(x.alignment is not None for x in a) and all(x.alignment is None for x in b)
    assert [x.cka for x in a] == [x.cka for x in b]  # CKA runs over the MGSM batch either way
    assert [x.top for x in a] == [x.top for x in b] and set(both.models) == {"math"}


# ---- bounds, progress, Stop ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw, words", [
    (dict(index=1, question="x"), "either"), (dict(), "either"), (dict(question=" "), "empty"),
    (dict(question="x" * 5000), "at most"), (dict(index=0, batch=MAX_BATCH + 1), "batch"),
    (dict(index=0, answer_tokens=100), "Answer tokens"), (dict(index=0, twin="t"), "free-text"),
    (dict(index=0, top=0), "Top tokens")])
def test_bounds_are_refused_with_the_fix(kw, words):
    with pytest.raises(UserError, match=words):
        LensConfig("xx", source=DEMO_MGSM, **kw).validate()


def test_data_problems_are_refused(tmp_path):
    tok = AutoTokenizer.from_pretrained(DEMO / "math")
    with pytest.raises(UserError, match="out of range"):
        prepare(LensConfig("xx", index=5000, source=DEMO_MGSM), tok, len(tok))
    with pytest.raises(UserError, match="other than en"):
        prepare(LensConfig("en", index=0, source=DEMO_MGSM), tok, len(tok))
    (tmp_path / "mgsm_xx.tsv").write_text((DEMO_MGSM / "mgsm_xx.tsv").read_text())
    (tmp_path / "languages.json").write_text((DEMO_MGSM / "languages.json").read_text())
    with pytest.raises(UserError, match="English"):
        prepare(LensConfig("xx", index=0, source=tmp_path), tok, len(tok))


def test_progress_and_stop(trio):
    seen, stop = [], threading.Event()
    cfg = LensConfig("xx", index=0, batch=3, source=DEMO_MGSM)
    run_lens(trio["math"], trio["lang"], Plan(b=1, u=1, tb=0, tu=0), config=cfg, forward="stream",
             progress=lambda f, d: seen.append(f))
    assert seen[-1] == 1.0 and seen == sorted(seen)

    def stop_midway(f, d):
        if f > 0.3:
            stop.set()

    with pytest.raises(UserError, match="Stopped"):
        run_lens(trio["math"], trio["lang"], Plan(b=1, u=1, tb=0, tu=0), config=cfg, forward="stream",
                 progress=stop_midway, cancel=stop)


# ---- figures, report, CLI, the page's entry point --------------------------------------------------------

def test_figures_and_report(tiny_lens, tmp_path):
    grid = lens_grid(tiny_lens)
    assert len(grid.data) == 4 and all(len(t.z) == 7 for t in grid.data)
    assert len(grid.data[0].z[0]) == len(tiny_lens.models["math"].answer.positions)
    assert any(s.type == "rect" for s in grid.layout.shapes)  # the merged model's swapped layers
    curves = lens_curves(tiny_lens)
    assert len(curves.data) == 4 * 4
    outlined = [s for s in curves.layout.shapes if s.line.color == "#d95f02"]
    assert {(s.x0, s.x1) for s in outlined} == {(-0.5, 1.5), (4.5, 5.5)}  # b=2, u=1 of 6 layers
    page = write_report(tiny_lens, tmp_path / "r.html").read_text()
    assert "Token classes" in page and tiny_lens.rule[:40] in page and page.count("plotly.js") >= 1


def test_cli(tmp_path):
    """`--json` prints only the numbers on stdout (the rest on stderr) and `--json-out FILE` writes them, as in
    every command."""
    out, js = tmp_path / "lens.html", tmp_path / "lens.json"
    r = run_cli("lens", "--math", str(DEMO_MODELS["math"]), "--lang", str(DEMO_MODELS["lang"]), "--b", "2", "--u", "0",
                "--tb", "0", "--tu", "0", "--mgsm-lang", "xx", "--index", "3", "--mgsm-dir", str(DEMO_MGSM),
                "--batch", "8", "--forward", "stream", "-o", str(out), "--json", "--json-out", str(js), "-q")
    assert r.returncode == 0, r.stderr
    data = json.loads(js.read_text())
    assert set(data["models"]) == {"math", "lang", "merged"} and out.exists()
    assert json.loads(r.stdout) == data  # stdout holds the JSON and nothing else
    assert "language expert (streamed" in r.stderr and f"wrote {js}" in r.stderr
    r = cli_in_process("lens", "--math", str(DEMO_MODELS["math"]), "--lang", str(DEMO_MODELS["lang"]), "--mgsm-lang",
                       "xx", "--index", "3", "--question", "q", "--mgsm-dir", str(DEMO_MGSM))  # a refusal: in process
    assert r.returncode == 2 and "either" in r.stderr and "Traceback" not in r.stderr


def test_workbench_lens_equals_run_lens():
    from layerswap.serving.workbench import Workbench

    plan = recommended_plan()
    cfg = LensConfig("xx", index=1, batch=4, source=DEMO_MGSM)
    wb = Workbench(device="cpu", engine="transformers")
    try:
        wb.load(str(DEMO_MODELS["math"]), str(DEMO_MODELS["lang"]), base=str(DEMO_MODELS["base"]))
        wb.build(plan)
        a = lens_workbench(wb, cfg)
    finally:
        wb.close()
    b = run_lens(DEMO_MODELS["math"], DEMO_MODELS["lang"], plan, base=DEMO_MODELS["base"], config=cfg, forward="stream")
    assert a.to_json() == b.to_json()
    assert not a.models["math"].streamed and b.models["math"].streamed


# ---- the demo organism shows its mechanism ------------------------------------------------------------

def test_demo_organism_aligns_kovani_with_english_after_layer_1():
    """The language expert (and the merge, which takes layers 0-1 from it) map Kovani onto the English twin's states
    by layer 1; the math expert (the base's layers 0-1) does not."""
    res = run_lens(DEMO_MODELS["math"], DEMO_MODELS["lang"], recommended_plan(), base=DEMO_MODELS["base"],
                   config=LensConfig("xx", index=0, batch=32, source=DEMO_MGSM), forward="stream")
    after = {r: res.models[r].layers[2] for r in ("math", "lang", "merged", "base")}  # JSON layer 2: after layer 1
    for r in ("lang", "merged"):
        assert after[r].alignment > 0.98 and after[r].cka > 0.95, r
    assert after["math"].alignment < after["lang"].alignment - 0.05
    assert after["math"].cka < after["lang"].cka - 0.05
    assert after["math"].alignment == after["base"].alignment  # the math expert kept the base's layers 0-1
