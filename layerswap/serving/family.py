"""A family evaluated: per language, the math expert, that language's expert, the swap and the baselines asked for,
on that language's MGSM test set, through the workbench (the one way the CLI and the page answer).

    family = Family.parse("math/", ["sw=sw/", "te=te/"], base="base/")
    checked = preflight(family, source="mgsm/")                        # everything cheap, before anything heavy
    recipes = {c: {"swap": swap_recipe, "soup": Recipe(MethodConfig("soup"))} for c in family.codes}
    report = evaluate_family(family, recipes, EvalConfig(limit=50, source="mgsm/"), EngineSettings())
    print(family_table(report).markdown())                             # `evaluation.table`

`preflight` is every check a family gets before a model loads: its shape (`Family.validate`, the cap), a test set
for every code (`mgsm.check_languages`, naming the member), and the compatibility of every member with the math
expert and the base (`models.family.check_family`, with the workbench's own adapter rule `merging.adapter_pair`).
`evaluate_family` asks the family's engine plan once (`family_plan`: `engines.choice.choose_family`), says the
outcome it runs and why (`FamilyPlan.runs`, the first `note`), then runs it in one workbench: the math expert and
its engine are loaded once, with the first language's expert, on the plan's trio (`Workbench.check(plan=...)`);
each later language is a language switch (`Workbench.switch_lang`: its expert into the running engines, the
previous one kept in memory when the plan is ``resident``, else released). Per language both experts are evaluated
on its set, then each recipe is built (`Workbench.build`) and only the merge is evaluated. Its `EvalReport` has a
model per table row (the two experts under their role names, each recipe under its label) and a language per column;
`on_language(report)` sees it after every language (what is done is never lost), `on_model(report)` after each model's
answers, and `cancel` stops it between batches, keeping what is answered.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Mapping

from layerswap.core.errors import UserError
from layerswap.core.roles import ROLE_NAMES
from layerswap.core.runtime import Progress, no_progress
from layerswap.core.hardware import Hardware
from layerswap.engines import EngineSettings, choose_family
from layerswap.engines.family import FamilyPlan
from layerswap.evaluation import mgsm
from layerswap.evaluation.run import EvalConfig, EvalReport
from layerswap.evaluation.table import LANG, MATH
from layerswap.merge.merging import adapter_pair
from layerswap.models.family import MAX_LANGS, Family, FamilyCheck, check_family
from layerswap.models.pairing import BASE_DISTANCE_THRESHOLD
from layerswap.recipe.recipes import Recipe


def check_test_sets(family: Family, source: str | None) -> None:
    """Every member's code has a test set in `source` (`mgsm.check_languages`: file names only); the first that
    has none is refused by member, with the languages the set holds."""
    for m in family.members:
        try:
            mgsm.check_languages([m.code], source)
        except UserError as e:
            raise UserError(f"--lang {m.code}={m.ref}: {e} Give an expert for one of those, or a set with "
                            f"mgsm_{m.code}.tsv (--mgsm-dir).") from None


def preflight(family: Family, source: str | None, *, cap: int = MAX_LANGS, force: bool = False,
              threshold: float = BASE_DISTANCE_THRESHOLD) -> FamilyCheck:
    """The family's shape and cap, a test set per code, then every member's compatibility (headers and a few MB of
    sampled weights): all before any engine starts."""
    family.validate(cap)
    check_test_sets(family, source)
    return check_family(family, force=force, threshold=threshold, pair_check=adapter_pair)


def check_recipes(family: Family, recipes: Mapping[str, Mapping[str, Recipe]], num_layers: int,
                  have_base: bool) -> list[str]:
    """Every language's recipes valid for the family's layers (and given a base when they need one); returns the
    row labels in order. Refused before anything loads."""
    missing = [c for c in family.codes if c not in recipes]
    if missing:
        raise UserError(f"No recipes for {', '.join(missing)}.")
    labels: list[str] = []
    for code in family.codes:
        for label, recipe in recipes[code].items():
            if label in (MATH, LANG):
                raise UserError(f"{label!r} names an expert row; give the recipe another label.")
            recipe.validate(num_layers)
            recipe.require_base(have_base, f"give --base, the model the family's experts were fine-tuned from "
                                           f"(needed by {label})")
            if label not in labels:
                labels.append(label)
    return labels


def family_plan(family: Family, settings: EngineSettings, *, hardware: Hardware | None = None) -> FamilyPlan:
    """The family's engine plan (`engines.choice.choose_family`), from its members' headers; starts nothing."""
    from layerswap.models.adapters import open_expert

    opened: list = []
    try:
        opened.append(open_expert(family.math, family.base))
        langs = {m.code: open_expert(m.ref, family.base) for m in family.members}
        opened += langs.values()
        return choose_family(settings, opened[0], langs, hardware=hardware)
    finally:
        for ck in opened:
            ck.close()


def evaluate_family(family: Family, recipes: Mapping[str, Mapping[str, Recipe]], config: EvalConfig,
                    settings: EngineSettings, *, force: bool = False, progress: Progress | None = None,
                    cancel: threading.Event | None = None,
                    on_language: Callable[[EvalReport], None] | None = None,
                    on_model: Callable[[EvalReport], None] | None = None,
                    note: Callable[[str], None] | None = None) -> EvalReport:
    """Per language of `family`: both experts, then each recipe of `recipes[code]` (label -> recipe), on that
    language's test set of `config` (its `langs` are ignored: each language is its member's code). Call
    `preflight` and `check_recipes` first. `note(text)`: the family plan's outcome that runs and why (first), then
    the engine line and the plan of each language;
    `on_model(report)`: after each model's answers of a language are in (the page fills its table with them)."""
    from layerswap.serving.workbench import Workbench

    p = progress or no_progress
    labels = list(dict.fromkeys(label for code in family.codes for label in recipes[code]))
    report = EvalReport(dataclasses.replace(config, langs=list(family.codes)), [MATH, LANG, *labels])
    steps = len(family.codes) * (2 + len(labels))
    done = 0

    def part(what: str, weight: int) -> Progress:
        start = done
        return lambda f, text: p((start + weight * f) / steps, f"{what}: {text}")

    fp = family_plan(family, settings)  # asked once, before anything starts
    outcome, why = fp.runs
    if note is not None:
        note(f"family plan: {outcome}{'' if outcome == fp.residency else f' ({why})'}; {fp.describe()}")
    if not fp.fits:
        raise UserError(fp.describe().replace("**", ""))
    wb = Workbench.from_settings(settings)
    try:
        for i, code in enumerate(family.codes):
            member = family.member(code)
            lang_cfg = dataclasses.replace(config, langs=[code])
            if i == 0:  # the math expert and its engine: once for the whole family
                wb.check(family.math, member.ref, family.base, force=force, plan=fp.trio,
                         progress=part(f"{code}: loading", 0))
                wb.start(part(f"{code}: loading", 0))
            else:  # the language switch the plan says: the next expert in, the previous kept when resident
                wb.switch_lang(member.ref, keep=outcome == "resident", force=force,
                               progress=part(f"{code}: loading", 0))
            _add(report, wb.evaluate(lang_cfg, ("math", "lang"), progress=part(code, 2), cancel=cancel), {})
            if on_model is not None:
                on_model(report)
            if note is not None:
                note(f"{code}: {wb.engine_note}")
            done += 2
            for label, recipe in recipes[code].items():
                if report.cancelled:
                    break
                wb.build(recipe, progress=part(f"{code}: building {label}", 0))
                if note is not None:
                    note(f"{code}: {label}: {recipe.title()}")
                _add(report, wb.evaluate(lang_cfg, ("merged",), progress=part(f"{code} {label}", 1), cancel=cancel),
                     {ROLE_NAMES["merged"]: label})
                if on_model is not None:
                    on_model(report)
                done += 1
            if on_language is not None:
                on_language(report)
            if report.cancelled:
                break
    finally:
        wb.close()
    p(1.0, "cancelled" if report.cancelled else "done")
    return report


def _add(report: EvalReport, part: EvalReport, rename: dict[str, str]) -> None:
    """One language's evaluation into the family's report, its models renamed to their rows."""
    for r in part.results:
        report.results.append(dataclasses.replace(r, model=rename.get(r.model, r.model)))
    for model, engine in part.engines.items():
        report.engines[rename.get(model, model)] = engine
    for model, seconds in part.seconds.items():
        row = rename.get(model, model)
        report.seconds[row] = report.seconds.get(row, 0.0) + seconds
    report.cancelled = report.cancelled or part.cancelled


__all__ = ["check_recipes", "check_test_sets", "evaluate_family", "family_plan", "preflight"]
