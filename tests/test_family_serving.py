"""Issue 40 (serving): a family evaluation runs the family's engine plan: the math expert and its engine loaded once
for the whole family, each language expert once, the merge rebuilt per language; the same table as evaluating each
language's trio on its own; the outcome it says is `plan_family`'s."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from layerswap.core import hardware
from layerswap.engines import EngineSettings
from layerswap.engines.family import plan_family
from layerswap.evaluation.run import EvalConfig
from layerswap.evaluation.table import LANG, MATH
from layerswap.models.adapters import open_expert
from layerswap.models.family import Family
from layerswap.recipe.methods import MethodConfig
from layerswap.recipe.plans import Plan
from layerswap.recipe.recipes import Recipe
from layerswap.serving import answering, switching
from layerswap.serving.family import evaluate_family
from layerswap.serving.workbench import Workbench
from tests.helpers import family_sets

LANGS = {"xx": "assets:demo/lang", "en": "assets:demo/unlocalised/lang", "sw": "assets:demo/ablation/lang_lora"}
FAMILY = Family.parse("assets:demo/math", [f"{c}={r}" for c, r in LANGS.items()], base="assets:demo/base")
RECIPES = {"swap": Recipe(plan=Plan(b=1, u=1, tb=0, tu=0)), "soup": Recipe(MethodConfig("soup"))}
SETTINGS = EngineSettings(engine="transformers", device="cpu")


@pytest.fixture(scope="module")
def mgsm_dir(tmp_path_factory) -> Path:
    return family_sets(tmp_path_factory.mktemp("family_mgsm"))


def config(mgsm_dir: Path) -> EvalConfig:
    return EvalConfig(langs=list(LANGS), limit=4, max_new_tokens=24, source=str(mgsm_dir))


def cells(report) -> dict:
    """(model, language) -> (n, correct), the table's cells."""
    out: dict = {}
    for r in report.results:
        n, c = out.get((r.model, r.lang), (0, 0))
        out[(r.model, r.lang)] = (n + 1, c + int(r.flexible_correct))
    return out


@pytest.fixture(scope="module")
def per_language(mgsm_dir) -> dict:
    """The old path: each language's trio evaluated on its own, in a workbench of its own."""
    out: dict = {}
    for code, ref in LANGS.items():
        cfg = dataclasses.replace(config(mgsm_dir), langs=[code])
        wb = Workbench.from_settings(SETTINGS)
        try:
            wb.load(FAMILY.math, ref, FAMILY.base)
            out |= cells(wb.evaluate(cfg, ("math", "lang")))
            for label, recipe in RECIPES.items():
                wb.build(recipe)
                out |= {(label, lang): v for (_, lang), v in cells(wb.evaluate(cfg, ("merged",))).items()}
        finally:
            wb.close()
    return out


def spy_loads(monkeypatch) -> Counter:
    """Every model read from disk into a transformers engine, by the folder it was read from."""
    loads: Counter = Counter()
    real = answering.load_model

    def load_model(ck, device="cpu"):
        loads[str(ck.path)] += 1
        return real(ck, device)

    monkeypatch.setattr(answering, "load_model", load_model)
    monkeypatch.setattr(switching, "load_model", load_model)
    return loads


def expected_loads() -> Counter:
    return Counter({str(open_expert(ref, FAMILY.base).path): 1 for ref in [FAMILY.math, *LANGS.values()]})


def test_family_loads_the_math_expert_once_and_matches_the_per_language_table(mgsm_dir, per_language,
                                                                             monkeypatch):
    loads, notes = spy_loads(monkeypatch), []
    report = evaluate_family(FAMILY, {c: RECIPES for c in LANGS}, config(mgsm_dir), SETTINGS, note=notes.append)
    assert loads == expected_loads()  # the math expert once for three languages, each language expert once
    assert cells(report) == per_language and len(per_language) == 4 * 3
    assert sum(c for _, c in per_language.values()) > 0  # not a comparison of zeros
    assert {m for m, _ in per_language} == {MATH, LANG, "swap", "soup"}
    # the outcome it says is the plan's, for the same models on this hardware
    math = open_expert(FAMILY.math, FAMILY.base)
    fp = plan_family(math, {c: open_expert(r, FAMILY.base) for c, r in LANGS.items()}, engine="transformers",
                     device="cpu")
    assert fp.residency == "resident" and notes[0] == f"family plan: resident; {fp.describe()}" and fp.why in notes[0]


def test_without_the_ram_for_every_expert_each_language_is_reloaded(mgsm_dir, per_language, monkeypatch):
    """RAM for the trio but not for every expert: the plan says reload, the evaluation reloads (the previous
    language expert released) and says so; loads and table as before."""
    here = hardware.current()
    math = open_expert(FAMILY.math, FAMILY.base)
    langs = {c: open_expert(r, FAMILY.base) for c, r in LANGS.items()}
    trio = plan_family(math, langs, engine="transformers", device="cpu", hardware=here).trio
    tight = dataclasses.replace(here, ram_available=trio.need_memory + max(ck.nbytes for ck in langs.values()) // 2)
    monkeypatch.setattr("layerswap.engines.family.current", lambda: tight)
    monkeypatch.setattr("layerswap.engines.planning.current", lambda: tight)
    fp = plan_family(math, langs, engine="transformers", device="cpu")
    assert fp.residency == "reload" and fp.runs == ("reload", fp.why)
    loads, notes = spy_loads(monkeypatch), []
    report = evaluate_family(FAMILY, {c: RECIPES for c in LANGS}, config(mgsm_dir), SETTINGS, note=notes.append)
    assert notes[0] == f"family plan: reload; {fp.describe()}" and fp.why in notes[0]
    assert loads == expected_loads() and cells(report) == per_language


def test_plans_that_keep_other_languages_engines_run_as_reload_in_an_evaluation():
    """``all_awake`` and ``sleep`` (GPU plans, table-tested in test_family_engines) run as reload, saying why;
    the outcomes an evaluation runs as planned are unchanged."""
    from layerswap.engines.family import FamilyPlan

    fp = FamilyPlan(trio=None, languages=3, residency="sleep", awake=3, asleep=4, reloaded=0, switch_seconds=1.0,
                    need_memory=0, why="two engines sleep and two wake")
    outcome, why = fp.runs
    assert outcome == "reload" and "sleep" in why and "visits each language once" in why
    assert dataclasses.replace(fp, residency="all_awake").runs[0] == "reload"
    for kept in ("trio", "adapters", "resident", "reload", "none"):
        assert dataclasses.replace(fp, residency=kept).runs == (kept, fp.why)
