"""What shipped models bring with them: their organism's MGSM set, the plan measured for them, their card.

A model shipped under `assets/` (an ``assets:`` reference, or a folder inside `assets/`) belongs to an organism:
the nearest folder above it with an MGSM set of its own (``mgsm/``), e.g. ``assets/demo`` for
``assets:demo/unlocalised/math``. The folder holding a pair's ``math`` expert and its language expert holds
what was measured for that pair (`demo.measured_plan`, `demo.organism_summary`). The CLI and the page both ask
here, so they test on the same set and open on the same plan:

    test_set("assets:demo2/math", "assets:demo2/lang")              # .../assets/demo2/mgsm
    test_set_for("qb", "assets:demo3/lang_qb")                      # .../assets/demo3/mgsm (has mgsm_qb.tsv)
    language_of("assets:demo3/lang_qb")                             # "qb": the family member's language
    choice(("assets:demo2/base", "assets:demo2/math", "assets:demo2/lang"))
        # Choice(dev=.../assets/demo2/mgsm/dev, questions=200, max_new_tokens=32): how its plan was chosen
    opening_plan(("assets:demo/base", "assets:demo/math", "assets:demo/lang"), 8)
        # Opening(Plan(b=2, u=0, ...), "the plan recommended for assets:demo (math + lang), chosen on its dev set")
    opening_plan(("assets:demo3/base", "assets:demo3/math", "assets:demo3/lang_qb"), 8)
        # Opening(Plan(b=2, u=1, ...), "the swap plan of assets:demo3's family table for qb, ...")

Models that are not shipped bring nothing: their test set is the one given (``--mgsm-dir``,
``$LAYERSWAP_MGSM_DIR``, the Hub) and they open on the literature's plan scaled to their layers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from layerswap.shipped import demo
from layerswap.shipped.results import Results, results_file
from layerswap.core.errors import UserError
from layerswap.recipe.plans import Plan, default_plan
from layerswap.recipe.recipes import Recipe
from layerswap.models.presets import ASSETS_PREFIX, assets_dir, assets_path, portable_ref, presets

Refs = tuple[str, str, str]  # base, math, lang, as the page and the CLI name them


@dataclass(frozen=True)
class Opening:
    """The plan a trio opens on, and where it comes from (said by `layerswap merge` and beside the sliders)."""

    plan: Plan
    why: str


@dataclass(frozen=True)
class Described:
    """What the page says about a trio: a label, a summary of what was measured on it, its card's folder."""

    label: str = ""
    summary: str = ""
    card: Path | None = None


def shipped(ref: str | os.PathLike | None) -> Path | None:
    """The folder of a model shipped under `assets/`, or None for any other reference (a Hub id, a folder
    elsewhere, an ``assets:`` reference to nothing)."""
    if not ref:
        return None
    ref = str(ref)
    root = assets_dir().resolve()
    try:
        path = assets_path(ref) if ref.startswith(ASSETS_PREFIX) else Path(ref).expanduser().resolve()
    except (UserError, OSError):
        return None
    return path if root in path.parents and path.is_dir() else None


@lru_cache(maxsize=64)
def _organism(path: Path) -> Path | None:
    root = assets_dir().resolve()
    for d in path.parents:
        if d == root or root not in d.parents:
            return None
        if any((d / "mgsm").glob("mgsm_*.tsv")):
            return d
    return None


def organism(ref: str | os.PathLike | None) -> Path | None:
    """The organism folder a shipped model belongs to (the nearest one above it with ``mgsm/``), else None."""
    path = shipped(ref)
    return _organism(path) if path is not None else None


def test_set(*refs: str | os.PathLike | None) -> Path | None:
    """The MGSM set the models bring: the organism's ``mgsm/`` of the first shipped one (give the math expert
    first), else None (then the set given to the command or app, ``$LAYERSWAP_MGSM_DIR``, or the Hub)."""
    for ref in refs:
        org = organism(ref)
        if org is not None:
            return org / "mgsm"
    return None


def test_set_for(code: str, *refs: str | os.PathLike | None) -> Path | None:
    """The shipped MGSM set that holds language `code`'s questions: the organism's ``mgsm/`` of the first shipped
    model among `refs` whose set has ``mgsm_CODE.tsv`` (a family's test set, found by each language's code), else
    None."""
    for ref in refs:
        org = organism(ref)
        if org is not None and (org / "mgsm" / f"mgsm_{code}.tsv").is_file():
            return org / "mgsm"
    return None


def language_of(ref: str | os.PathLike | None) -> str | None:
    """The MGSM code a shipped family member is the language expert of: a folder ``lang_CODE`` in an organism
    whose set holds CODE (``assets:demo3/lang_qa`` -> ``"qa"``); None for any other model."""
    path = shipped(ref)
    if path is None or not path.name.startswith("lang_"):
        return None
    code = path.name.removeprefix("lang_")
    return code if test_set_for(code, ref) is not None else None


@dataclass(frozen=True)
class Choice:
    """How a shipped pair's plan is chosen (by its card, and by a search on it): on the organism's own dev questions
    (``mgsm/dev``, never its test set), the first `questions` of them (None: all), answers of `max_new_tokens`
    tokens (None: the library's default). The rule: the highest flexible accuracy on those questions; a tie goes
    to the plan that swaps fewer layers (`demo_results.ResultsWriter.best_dev`, `search.run`)."""

    dev: Path
    questions: int | None = None
    max_new_tokens: int | None = None

    def describe(self) -> str:
        n = f"the first {self.questions}" if self.questions else "all"
        return f"{n} questions of {portable_ref(self.dev)} (the organism's dev file, never its test set)"


def choice(refs: Refs) -> Choice | None:
    """The dev questions and answer length the models' own plan was chosen with: the organism's ``mgsm/dev`` (of
    the math expert's organism, else the language expert's), with the measured pair's question count and answer
    length when the pair was measured; None for models that bring no dev file (a search then draws its split)."""
    for ref in (refs[1], refs[2]):
        org = organism(ref)
        if org is not None and any((org / "mgsm" / "dev").glob("mgsm_*.tsv")):
            break
    else:
        return None
    pair = _pair(refs[1], refs[2])
    res = Results.of_pair(*pair) if pair is not None else None
    if res is None:
        return Choice(org / "mgsm" / "dev")
    dev = res.dev().get(res.plan_info.get("name", ""))
    return Choice(org / "mgsm" / "dev", len(dev.correct) if dev is not None else None, int(res.max_new_tokens))


def _pair(math: str | None, lang: str | None) -> tuple[Path, str] | None:
    """The experts' folder of a shipped pair (``X/math`` with ``X/<language expert>``) and the language expert's
    folder name, as `scripts/eval_demo.py` lays a measured pair out; None for any other two models."""
    m, lg = shipped(math), shipped(lang)
    if m is None or lg is None or m.name != "math" or m.parent != lg.parent:
        return None
    return m.parent, lg.name


def opening_plan(refs: Refs, num_layers: int) -> Opening:
    """The plan measured for a shipped pair (chosen on its dev set); else, for two shipped experts of one organism
    that were not measured as a pair (its LoRA, IA3 or prefix experts, ``assets:demo/ablation/*``), the plan
    measured for the organism's own pair; else the literature's plan scaled to `num_layers` (`plans.default_plan`)."""
    pair, org = _pair(refs[1], refs[2]), organism(refs[1])
    measured = [(*pair, "")] if pair is not None else []
    if org is not None and org == organism(refs[2]):
        measured.append((org, "lang", "; these experts share its organism but were not measured as a pair"))
    for folder, lang, why in measured:
        plan = demo.measured_plan(folder, lang)
        if plan is None:
            continue
        try:
            plan.validate(num_layers)
        except UserError:
            continue
        return Opening(plan, f"the plan recommended for {portable_ref(folder)} (math + {lang}), chosen on its dev "
                             f"set{why}")
    fam = _family_plan(refs[1], refs[2])
    if fam is not None:
        try:
            fam[0].validate(num_layers)
            return Opening(fam[0], f"the swap plan of {portable_ref(fam[1])}'s family table for "
                                   f"{language_of(refs[2])}, fixed before it was measured (its card)")
        except UserError:
            pass
    return Opening(default_plan(num_layers), f"the literature's b=5 u=2 tb=1 tu=1 at 32 layers, scaled to "
                                             f"{num_layers} layers")


def _family_plan(math: str | None, lang: str | None) -> tuple[Plan, Path] | None:
    """The swap plan a shipped family's table (its organism's ``family_table.json``, as `layerswap eval --json`
    wrote it) gives this member, and the organism; None for any other two models."""
    code, org = language_of(lang), organism(math)
    if code is None or org is None or org != organism(lang):
        return None
    try:
        raw = json.loads((org / "family_table.json").read_text())["recipes"][code]["swap"]
        return Recipe.from_dict(raw).plan, org
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return None


def showcase(refs: Refs) -> tuple[str, int] | None:
    """The language and question to open Ask on for a shipped pair (`demo.showcase_question`), else None."""
    pair = _pair(refs[1], refs[2])
    return demo.showcase_question(*pair) if pair is not None else None


def preset_of(refs: Refs) -> str | None:
    """The name of the preset whose models these are, if any."""
    return next((name for name, p in presets().items() if (p.base, p.math, p.lang) == tuple(refs)), None)


def describe(refs: Refs) -> Described:
    """The page's banner for a trio: its preset's label (or the shipped pair's name), the measured summary of a
    shipped pair, and the organism whose card belongs to it."""
    name = preset_of(refs)
    pair = _pair(refs[1], refs[2])
    label = presets()[name].label if name else (f"shipped experts {portable_ref(pair[0])}/{{math, {pair[1]}}}"
                                                 if pair else "")
    summary = ""
    if pair is not None and pair[1] == "lang" and results_file(*pair).is_file():  # the pair's own summary
        summary = demo.organism_summary(pair[0])
    org = organism(refs[1])
    card = org if org is not None and (org / "README.md").is_file() else None
    return Described(label, summary, card)
