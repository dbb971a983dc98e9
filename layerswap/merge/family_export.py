"""Export a family's merges: one math expert and N language experts, one folder per language.

    export_family(math, {"sw": sw, "te": te}, plan, "OUT", base=base)          # one shared plan
    export_family(math, {"sw": sw, "te": te}, {"sw": p1, "te": p2}, "OUT")     # a plan per language

writes ``OUT/<code>/``, each a whole export of `merging.export_merge` (or of `export_adapter_merge` for
adapter experts) with its model card (the code in its front matter) and mergekit config, plus
``OUT/layerswap-family.json`` and a short ``OUT/README.md`` listing the languages. Every check
(codes, plans, each member against the math expert and the base, the output folders, the disk for
all N merges) runs before anything is written; each language's folder is complete when the next
starts, and the index is rewritten after each, so a failure keeps the languages written so far.
Language experts arrive as ``dict[code, Checkpoint]`` (what `layerswap.models.family` holds).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Mapping, Union

from layerswap.core.errors import UserError
from layerswap.core.runtime import Progress
from layerswap.core.scratch import check_disk
from layerswap.core.version import __version__
from layerswap.merge.card import check_languages, model_entry
from layerswap.merge.merging import (DEFAULT_SHARD_BYTES, MergeSummary, export_adapter_merge, export_merge,
                                     exports_as_adapter)
from layerswap.merge.outputs import EXPORT_MARK, check_output_folder, input_paths
from layerswap.models.checkpoints import Checkpoint
from layerswap.models.family import check_code
from layerswap.models.pairing import BASE_DISTANCE_THRESHOLD, check_mergeable
from layerswap.recipe.plans import Plan
from layerswap.recipe.recipes import Recipe, as_recipe

FAMILY_MARK = "layerswap-family.json"  # the family's index; --overwrite replaces only folders holding it
PlanLike = Union[Recipe, Plan]


def family_recipes(plans: PlanLike | Mapping[str, PlanLike], codes: list[str], num_layers: int,
                   have_base: bool) -> dict[str, Recipe]:
    """Each language's recipe: the shared one, or one per language (every code of the family, no other), validated."""
    if isinstance(plans, Mapping):
        extra = [c for c in plans if c not in codes]
        if extra:
            raise UserError(f"A plan is given for {', '.join(map(str, extra))}, not a language of this family "
                            f"({', '.join(codes)}): drop it or add that language expert.")
        missing = [c for c in codes if c not in plans]
        if missing:
            raise UserError(f"No plan for {', '.join(missing)}: give one plan per language, or one shared plan.")
        recipes = {c: as_recipe(plans[c]) for c in codes}
    else:
        shared = as_recipe(plans)
        recipes = {c: shared for c in codes}
    for code, recipe in recipes.items():
        try:
            recipe.layer_weights(num_layers)  # validates the method and the plan
            recipe.require_base(have_base)
        except UserError as e:
            raise UserError(f"The plan for {code}: {e}") from None
    return recipes


def check_codes(codes: list[str]) -> list[str]:
    """The family's language codes, each a code's shape (`models.family.check_code`: they name the folders)."""
    if not codes:
        raise UserError("A family needs at least one language expert: give one per language as CODE=REF.")
    for c in codes:
        if not isinstance(c, str):
            raise UserError(f"Language codes must be text such as sw or te (got {type(c).__name__}).")
        check_code(c)
        check_languages([c])  # it goes into its card's front matter too
    return list(codes)


def export_family(math: Checkpoint, langs: Mapping[str, Checkpoint], plans: PlanLike | Mapping[str, PlanLike],
                  out: str | os.PathLike, *, base: Checkpoint | None = None, device: str = "auto",
                  shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False, force: bool = False,
                  base_distance_threshold: float = BASE_DISTANCE_THRESHOLD, protect: tuple = (),
                  adapter: bool = False, progress: Progress | None = None) -> dict[str, MergeSummary | Path]:
    """Write each language's merge to ``out/<code>/`` (see the module docstring); returns what each export
    returned, by code. `plans`: one recipe or plan for all, or a mapping code -> recipe or plan."""
    codes = check_codes(list(langs))
    recipes = family_recipes(plans, codes, math.num_layers, base is not None)
    pairings = {}
    for code in codes:
        check = check_mergeable(math, langs[code], base, threshold=base_distance_threshold, force=force)
        problem = check.problem()
        if problem:
            raise UserError(f"Language expert {code} ({langs[code].ref}): {problem}")
        pairings[code] = check.pairing
    inputs = input_paths(math, base, *langs.values(), extra=protect)
    root = check_output_folder(out, inputs, overwrite, mark=FAMILY_MARK)
    for code in codes:  # an existing member folder must be an earlier export (with --overwrite)
        check_output_folder(root / code, inputs, overwrite)
    root.mkdir(parents=True, exist_ok=True)
    full = [c for c in codes if not exports_as_adapter(math, langs[c], adapter)]
    check_disk(len(full) * math.nbytes, root, f"{len(full)} merged models to {root.name}")  # before a byte is written
    done: dict[str, MergeSummary | Path] = {}
    for i, code in enumerate(codes):
        lang, recipe = langs[code], recipes[code]

        def part(frac: float, msg: str, i: int = i, code: str = code) -> None:
            if progress:
                progress((i + frac) / len(codes), f"{code}: {msg}")

        if code not in full:
            done[code] = export_adapter_merge(math, lang, recipe, root / code, base=base, overwrite=overwrite,
                                              force=force, protect=protect, languages=[code])
        else:
            done[code] = export_merge(math, lang, recipe, root / code, base=base, device=device,
                                      shard_bytes=shard_bytes, overwrite=overwrite, force=force,
                                      base_distance_threshold=base_distance_threshold, protect=protect,
                                      languages=[code], progress=part)
        _write_index(root, math, base, langs, recipes, list(done))
    if progress:
        progress(1.0, f"{len(codes)} merges written")
    return done


def _write_index(root: Path, math: Checkpoint, base: Checkpoint | None, langs: Mapping[str, Checkpoint],
                 recipes: dict[str, Recipe], written: list[str]) -> None:
    """``layerswap-family.json`` and README.md of the family folder (the languages written so far)."""
    shared = len({json.dumps(r.to_dict(), sort_keys=True) for r in recipes.values()}) == 1
    ref = {c: model_entry(langs[c], "lang")["ref"] for c in written}  # Hub ids and folder names, as the cards show
    math_ref = model_entry(math, "math")["ref"]
    index = {
        "layerswap_version": __version__, "math": math_ref,
        "base": model_entry(base, "base")["ref"] if base is not None else None, "shared_plan": shared,
        "languages": {c: {"folder": c, "lang": ref[c], "recipe": recipes[c].to_dict(), "card": f"{c}/README.md",
                          "mark": f"{c}/{EXPORT_MARK}"} for c in written},
        "pending": [c for c in recipes if c not in written],
    }
    rows = "\n".join(f"| {c} | `{ref[c]}` | {recipes[c].title()} | [{c}/]({c}/README.md) |" for c in written)
    readme = (f"# Layer-swap family of {math_ref}\n\nOne merge per language: the math expert `{math_ref}` with each "
              f"language expert, {'one shared plan' if shared else 'a plan per language'}. Each folder is a whole "
              "model with its card (how it was built, the mergekit config that rebuilds it).\n\n"
              f"| language | language expert | plan | folder |\n|---|---|---|---|\n{rows}\n")
    for name, text in ((FAMILY_MARK, json.dumps(index, indent=2)), ("README.md", readme)):
        tmp = root / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(root / name)
