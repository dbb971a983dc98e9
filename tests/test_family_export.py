"""layerswap.merge.family_export: a family's merges, one folder per language, each the export of its pair
(same weights, its own card and mergekit config), with every check before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from layerswap import Checkpoint, Plan, UserError, export_merge
from layerswap.merge.family_export import FAMILY_MARK, export_family
from layerswap.shipped.demo import make_tiny_llama, perturb
from tests.helpers import read_dir

SHARED = Plan(b=1, u=2, tb=1, tu=0)
OTHER = Plan(b=2, u=1, tb=0, tu=1)


@pytest.fixture(scope="module")
def family(tmp_path_factory, trio) -> dict[str, Checkpoint]:
    root = tmp_path_factory.mktemp("fam")
    return {"base": Checkpoint.open(trio["base"]), "math": Checkpoint.open(trio["math"]),
            "sw": Checkpoint.open(trio["lang"]), "te": Checkpoint.open(perturb(trio["base"], root / "te", scale=0.05,
                                                                                seed=9))}


def langs(f) -> dict[str, Checkpoint]:
    return {"sw": f["sw"], "te": f["te"]}


def front_matter(card: str) -> dict:
    return yaml.safe_load(card.split("---\n")[1])


def test_one_folder_per_language_equal_to_the_pair_export(family, tmp_path):
    out = tmp_path / "fam"
    done = export_family(family["math"], langs(family), {"sw": SHARED, "te": OTHER}, out, base=family["base"])
    assert sorted(p.name for p in out.iterdir()) == sorted(["sw", "te", FAMILY_MARK, "README.md"])
    for code, plan in (("sw", SHARED), ("te", OTHER)):
        assert done[code].out == out / code
        pair = export_merge(family["math"], family[code], plan, tmp_path / f"pair-{code}", base=family["base"],
                            languages=[code])
        a, b = read_dir(out / code), read_dir(pair.out)
        assert a.keys() == b.keys() and all(a[n].equal(b[n]) for n in a)
        card = (out / code / "README.md").read_text()
        assert front_matter(card)["language"] == [code]
        prov = json.loads((out / code / "layerswap.json").read_text())
        assert prov["plan"] == plan.to_dict() and prov["models"]["lang"]["ref"] == Path(family[code].path).name
        yml = yaml.safe_load(prov["mergekit_yaml"])
        assert yml == yaml.safe_load(json.loads((pair.out / "layerswap.json").read_text())["mergekit_yaml"])
        assert prov["mergekit_yaml"].strip() in card
    index = json.loads((out / FAMILY_MARK).read_text())
    assert list(index["languages"]) == ["sw", "te"] and not index["shared_plan"] and index["pending"] == []
    assert index["languages"]["te"]["recipe"]["plan"] == OTHER.to_dict()
    readme = (out / "README.md").read_text()
    assert "| te | `te` |" in readme and str(tmp_path) not in readme + json.dumps(index)  # no machine path


def test_a_shared_plan_and_overwrite(family, tmp_path):
    out = tmp_path / "fam"
    export_family(family["math"], langs(family), SHARED, out, base=family["base"])
    index = json.loads((out / FAMILY_MARK).read_text())
    assert index["shared_plan"] and {v["recipe"]["plan"]["b"] for v in index["languages"].values()} == {1}
    with pytest.raises(UserError, match="already exists"):
        export_family(family["math"], langs(family), SHARED, out, base=family["base"])
    export_family(family["math"], langs(family), OTHER, out, base=family["base"], overwrite=True)
    assert json.loads((out / "te" / "layerswap.json").read_text())["plan"] == OTHER.to_dict()
    foreign = tmp_path / "foreign"
    (foreign / "sw").mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not an earlier layerswap export"):
        export_family(family["math"], langs(family), SHARED, foreign, base=family["base"], overwrite=True)
    assert (foreign / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("bad, match", [
    ({"plans": {"sw": SHARED}}, "No plan for te"),
    ({"plans": {"sw": SHARED, "te": SHARED, "ja": SHARED}}, "not a language of this family"),
    ({"plans": Plan(b=9, u=9)}, "The plan for sw"),
    ({"codes": {"Swahili": "sw", "te": "te"}}, "not a language code"),
    ({"codes": {}}, "at least one language"),
    ({"other_shape": True}, "Language expert ja"),
])
def test_bad_input_is_refused_before_anything_is_written(family, tmp_path, tokenizer, bad, match):
    members = {code: family[src] for code, src in bad.get("codes", {"sw": "sw", "te": "te"}).items()}
    if bad.get("other_shape"):
        members["ja"] = Checkpoint.open(make_tiny_llama(tmp_path / "other", layers=3, seed=0, tokenizer=tokenizer))
    out = tmp_path / "fam"
    with pytest.raises(UserError, match=match):
        export_family(family["math"], members, bad.get("plans", SHARED), out, base=family["base"])
    assert not out.exists()


def test_the_workbench_exports_and_analyses_a_family(family, trio, tmp_path, monkeypatch):
    from layerswap.analysis import analyze
    from layerswap.serving.workbench import Workbench

    monkeypatch.setenv("LAYERSWAP_CACHE", str(tmp_path / "cache"))
    wb = Workbench(engine="transformers")
    wb.check(str(trio["math"]), str(trio["lang"]), str(trio["base"]))
    with pytest.raises(UserError, match="Build the merge first"):
        wb.export_family(tmp_path / "fam", langs(family))
    done = wb.export_family(tmp_path / "fam", langs(family), plans={"sw": SHARED, "te": OTHER})
    assert sorted(done) == ["sw", "te"] and (tmp_path / "fam" / "te" / "README.md").is_file()
    fam = wb.family_analysis(langs(family))
    pair = analyze(family["base"], family["math"], family["te"], ks=(1.0,), cache=False)
    assert fam["te"].values("lang", "relative").tolist() == pair.values("lang", "relative").tolist()
    assert fam["sw"].topk_at(1.0).joint.tolist() != fam["te"].topk_at(1.0).joint.tolist()


def test_cli_merge_over_a_family_writes_a_folder_per_language(family, tmp_path):
    """`layerswap merge --lang CODE=L ...` (repeated): the same folders as `export_family`, the shared plan from the
    flags and a language's own from --lang-recipe; family-only flags refused for a pair."""
    from layerswap.cli import main
    from layerswap.recipe.recipes import Recipe

    (tmp_path / "te.yaml").write_text(yaml.safe_dump(Recipe(plan=OTHER).to_dict()))
    args = ["merge", "--math", str(family["math"].path), "--base", str(family["base"].path),
            "--lang", f"sw={family['sw'].path}", "--lang", f"te={family['te'].path}", "--b", "1", "--u", "2",
            "--tb", "1", "--tu", "0", "--lang-recipe", f"te={tmp_path / 'te.yaml'}", "-q"]
    assert main([*args, "-o", str(tmp_path / "cli")]) == 0
    export_family(family["math"], langs(family), {"sw": SHARED, "te": OTHER}, tmp_path / "api", base=family["base"])
    for code in ("sw", "te"):
        a, b = read_dir(tmp_path / "cli" / code), read_dir(tmp_path / "api" / code)
        assert a.keys() == b.keys() and all(a[n].equal(b[n]) for n in a), code
    assert main(["merge", "--math", str(family["math"].path), "--lang", str(family["sw"].path), "--lang-recipe",
                 f"sw={tmp_path / 'te.yaml'}", "-o", str(tmp_path / "pair")]) == 2
    assert not (tmp_path / "pair").exists()
