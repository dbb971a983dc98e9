"""The model card an export writes (and pushes as the repo README), checked field by field."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import torch
import yaml

from layerswap import Checkpoint, MethodConfig, Plan, Sources, UserError, __version__, export_merge
from layerswap.models.cache import fingerprint
from layerswap.merge.card import RECIPE_KEYS, _mergekit_ref, attach_eval, model_entry
from layerswap.cli import main as cli
from layerswap.engines import TransformersEngine
from layerswap.evaluation.run import EvalConfig, EvalReport, evaluate
from layerswap.merge.interop import mergekit_config
from layerswap.recipe.recipes import Recipe
from tests.helpers import DEMO_MGSM, read_dir

SHA_M, SHA_L = "1" * 40, "2" * 40
PLAN = Plan(b=1, u=2, tb=1, tu=0)


def _block(card: str, lang: str) -> str:
    m = re.search(rf"```{lang}\n(.*?)\n```", card, re.DOTALL)
    assert m, f"no {lang} block in the card"
    return m.group(1)


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def _hub_snapshot(src, cache, repo: str, sha: str):
    """A model as huggingface_hub leaves a download: .../models--owner--name/snapshots/<commit>/."""
    snap = cache / f"models--{repo.replace('/', '--')}" / "snapshots" / sha
    shutil.copytree(src, snap)
    return Checkpoint.from_folder(snap, repo)


@pytest.fixture(scope="module")
def hub_export(trio, tmp_path_factory):
    """Experts downloaded from the Hub (snapshot folders), a local base, swap plan, two card languages."""
    root = tmp_path_factory.mktemp("card")
    math = _hub_snapshot(trio["math"], root / "hf", "me/math-expert", SHA_M)
    lang = _hub_snapshot(trio["lang"], root / "hf", "me/swahili-expert@main", SHA_L)
    base = Checkpoint.open(trio["base"])
    out = root / "merged"
    export_merge(math, lang, PLAN, out, base=base, languages=["sw", "EN"])
    return out, math, lang, base


def test_front_matter_is_a_hub_model_card(hub_export):
    out, *_ = hub_export
    meta = _front_matter((out / "README.md").read_text())
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["base_model"] == ["me/math-expert", "me/swahili-expert"] and meta["base_model_relation"] == "merge"
    assert meta["tags"] == ["merge", "layerswap", "layer-swapping"]
    assert meta["language"] == ["en", "sw"]


def test_models_with_references_and_revisions_and_no_server_path(hub_export, trio):
    out, *_ = hub_export
    card, prov_text = (out / "README.md").read_text(), (out / "layerswap.json").read_text()
    assert f"| math expert | [`me/math-expert`](https://huggingface.co/me/math-expert) | Hub commit `{SHA_M}` |" in card
    assert f"| language expert | [`me/swahili-expert`](https://huggingface.co/me/swahili-expert) | Hub commit `{SHA_L}` |" in card
    fp = fingerprint(sorted(trio["base"].glob("*.safetensors")))
    assert f"| base model | `base` (local folder) | not on the Hub | `{fp}` |" in card
    prov = json.loads(prov_text)
    assert prov["models"]["base"] == {"role": "base model", "ref": "base", "source": "local folder", "revision": None,
                                      "fingerprint": fp}
    assert prov["models"]["math"]["revision"] == SHA_M and prov["models"]["lang"]["ref"] == "me/swahili-expert"
    for text in (card, prov_text):  # no absolute path of the machine that merged
        assert str(out.parent) not in text and str(trio["base"]) not in text and "/tmp" not in text


def test_version_plan_and_machine_readable_recipe(hub_export):
    out, *_ = hub_export
    card, prov = (out / "README.md").read_text(), json.loads((out / "layerswap.json").read_text())
    assert f"Built with layerswap {__version__} on {prov['created']}" in card and prov["layerswap_version"] == __version__
    assert f"- **Plan**: {PLAN.title()}" in card and Sources(PLAN, 6).describe() in card
    assert "- **Method**: Layer swapping" in card
    lw = PLAN.layer_weights(6)
    for i, w in enumerate(lw):
        assert re.search(rf"^\| {i} \| {w:.4g} \| ", card, re.MULTILINE), f"layer {i}"
    recipe = json.loads(_block(card, "json"))
    assert list(recipe) == list(RECIPE_KEYS) and recipe == {k: prov[k] for k in RECIPE_KEYS}
    assert Plan.from_dict(recipe["plan"]) == PLAN and MethodConfig.from_dict(recipe["method"]) == MethodConfig()
    assert recipe["layer_weights_lang"] == lw and recipe["non_layer_weights_lang"]["model.embed_tokens.weight"] == 1.0


def test_mergekit_yaml_pins_the_hub_commits(hub_export):
    out, math, lang, _ = hub_export
    card = (out / "README.md").read_text()
    want = mergekit_config(math, lang, PLAN, refs=(f"me/math-expert@{SHA_M}", f"me/swahili-expert@{SHA_L}"))
    assert yaml.safe_load(_block(card, "yaml")) == want
    assert json.loads((out / "layerswap.json").read_text())["mergekit_yaml"].rstrip() == _block(card, "yaml")
    assert "Local models are named by folder" not in card  # both experts are on the Hub


def test_cards_mergekit_yaml_rebuilds_the_export(trio_bf16, tmp_path):
    """Local experts are named by folder: mergekit run from their parent folder gives the same bits."""
    from tests.test_interop import _mergekit_bin

    out = tmp_path / "ours"
    export_merge(Checkpoint.open(trio_bf16["math"]), Checkpoint.open(trio_bf16["lang"]), PLAN, out)
    card = (out / "README.md").read_text()
    assert "Local models are named by folder (`./math`, `./lang`)" in card
    (tmp_path / "merge.yml").write_text(_block(card, "yaml"))
    r = subprocess.run([_mergekit_bin(), str(tmp_path / "merge.yml"), str(tmp_path / "theirs"), "--quiet"],
                       cwd=trio_bf16["math"].parent, check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ours, theirs = read_dir(out), read_dir(tmp_path / "theirs")
    assert set(ours) == set(theirs)
    for name in ours:
        assert torch.equal(ours[name].view(torch.int16), theirs[name].view(torch.int16)), name


def test_a_method_without_mergekit_equivalent_says_so(trio, tmp_path):
    method = MethodConfig("ties", density=0.5)
    export_merge(Checkpoint.open(trio["math"]), Checkpoint.open(trio["lang"]), Recipe(method), tmp_path / "o",
                 base=Checkpoint.open(trio["base"]))
    card, prov = (tmp_path / "o" / "README.md").read_text(), json.loads((tmp_path / "o" / "layerswap.json").read_text())
    meta = _front_matter(card)
    assert meta["tags"] == ["merge", "layerswap"] and "base_model" not in meta and "language" not in meta
    assert f"- **Method**: {method.describe()}" in card and prov["plan"] is None and prov["mergekit_yaml"] is None
    assert "No mergekit equivalent: export-yaml writes mergekit's linear method" in card
    assert "Not evaluated yet" in card and prov["evaluation"] is None


def test_an_adapter_expert_is_shown_with_its_base(trio, tmp_path):
    merged = tmp_path / "adapters-merged" / "k"
    shutil.copytree(trio["math"], merged)
    (merged / "layerswap-adapter.json").write_text(json.dumps({"adapter": "/x/lora", "base": str(trio["base"])}))
    ck = Checkpoint.open(merged)
    ck.ref, ck.adapter = "me/math-lora", str(tmp_path / "models--me--math-lora" / "snapshots" / "abc")
    entry = model_entry(ck, "math")
    assert entry == {"role": "math expert", "ref": "me/math-lora", "source": "hub", "revision": "abc",
                     "fingerprint": ck.fingerprint(), "adapter_merged_into": "base"}
    assert _mergekit_ref(entry) == "./base+me/math-lora@abc"  # mergekit's model+LoRA syntax


# ---- measured MGSM results ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def evaluated(hub_export, trio):
    out, *_ = hub_export
    before = (out / "README.md").read_text()
    cfg = EvalConfig(langs=["en", "xx"], limit=2, max_new_tokens=4, source=str(DEMO_MGSM))
    engines = {"merged": TransformersEngine.from_pretrained(out), "math expert": TransformersEngine.from_pretrained(trio["math"])}
    report = evaluate(engines, cfg)
    prov = attach_eval(out, report, model="merged")
    return out, before, report, prov


def test_evaluation_results_in_the_card(evaluated):
    out, before, report, prov = evaluated
    card = (out / "README.md").read_text()
    assert json.loads((out / "layerswap.json").read_text()) == prov
    ev = prov["evaluation"]
    assert ev["task"] == "mgsm_native_cot" and ev["limit"] == 2 and ev["shots"] == 0 and ev["data"] == "local folder mgsm"
    assert ev["models"] == ["merged model", "math expert"] and ev["engines"] == {"merged model": "transformers",
                                                                                  "math expert": "transformers"}
    section = card.split("## Evaluation (MGSM)")[1]
    assert "`mgsm_native_cot` protocol, 0-shot, greedy, 4 new tokens, the first 2 questions of each language" in section
    assert f"Measured with layerswap {__version__} on {ev['date']}" in section and "data: local folder mgsm" in section
    assert "| language | n | merged model | math expert |" in section
    for metric in ("flexible", "strict"):
        for row in report.table(metric):
            cells = [row["language"], row["n"], row["merged"], row["math expert"]]
            line = "| " + " | ".join("–" if c is None else str(c) for c in cells) + " |"
            assert line in section.split(f"Accuracy (%), {metric}")[1], (metric, line)
    assert report.table()[0]["merged"] == round(100 * report.accuracy("merged", "en"), 1)
    # the constructed test language is not an ISO code: the front matter gains English only
    assert _front_matter(card)["language"] == ["en", "sw"]
    # everything before the evaluation is rendered from the same provenance, unchanged
    assert card.split("## Models")[1].split("## Evaluation")[0] == before.split("## Models")[1].split("## Evaluation")[0]


def test_attach_eval_refusals(evaluated, tmp_path):
    out, _, report, _ = evaluated
    with pytest.raises(UserError, match="not a layerswap export .*layerswap merge -o DIR"):
        attach_eval(tmp_path, report)
    with pytest.raises(UserError, match="has no model 'lang' .*merged, math expert.*say which"):
        attach_eval(out, report, model="lang")
    with pytest.raises(UserError, match="has no model 'merged model'"):
        attach_eval(out, report)  # two models, none called "merged model": which one is this export?
    with pytest.raises(UserError, match="measured nothing"):
        attach_eval(out, EvalReport(report.config, ["merged"]))
    old = tmp_path / "old"  # an export written before the card had its models section
    old.mkdir()
    (old / "layerswap.json").write_text(json.dumps({"sources": {"math": "/x/math"}}))
    with pytest.raises(UserError, match="older layerswap.*export the merge again"):
        attach_eval(old, report, model="merged")


# ---- the CLI paths --------------------------------------------------------------------------------

def test_merge_languages_and_eval_card_cli(trio, tmp_path, capsys):
    models = ["--math", str(trio["math"]), "--lang", str(trio["lang"]), "--b", "1", "--u", "1"]
    out = tmp_path / "m"
    assert cli(["merge", *models, "-o", str(out), "--languages", "sw,en", "-q"]) == 0
    assert _front_matter((out / "README.md").read_text())["language"] == ["en", "sw"]
    assert cli(["merge", *models, "-o", str(tmp_path / "bad"), "--languages", "swahili"]) == 2
    assert "ISO 639 codes such as sw or en (got swahili)" in capsys.readouterr().err
    ev = ["--langs", "en", "--limit", "1", "--max-new-tokens", "3", "--mgsm-dir", str(DEMO_MGSM),
          "--engine", "transformers", "-q"]
    assert cli(["eval", "--model", str(out), "--card", str(out), *ev]) == 0
    assert "wrote the MGSM results into the model card" in capsys.readouterr().err
    prov = json.loads((out / "layerswap.json").read_text())
    assert prov["evaluation"]["models"] == ["merged model"] and prov["evaluation"]["accuracy"]["flexible"][0]["n"] == 1
    assert "| language | n | merged model |" in (out / "README.md").read_text()
    # refusals, said before any model loads or any question is asked
    assert cli(["eval", "--model", str(trio["math"]), "--card", str(out), *ev]) == 2
    assert f"give --model {out} --card {out}" in capsys.readouterr().err
    assert cli(["eval", "--model", str(trio["math"]), "--card", str(tmp_path), *ev]) == 2
    assert "is not a layerswap export" in capsys.readouterr().err
    other = ["--math", str(trio["math"]), "--lang", str(trio["lang"]), "--b", "2", "--u", "1"]
    assert cli(["eval", *other, "--card", str(out), *ev]) == 2
    assert "is not this merge: the plan (swap b=1 u=1" in capsys.readouterr().err


def test_a_shipped_model_is_named_by_its_assets_reference():
    ck = Checkpoint.open("assets:demo/math")
    entry = model_entry(ck, "math")
    assert (entry["ref"], entry["source"], entry["revision"]) == ("assets:demo/math", "layerswap asset", None)
    assert _mergekit_ref(entry) == "./math"
