"""Model cards: what an export says about itself, in ``layerswap.json`` and ``README.md`` (the Hub card).

    from layerswap.merge.card import attach_eval
    attach_eval("merged/", report)          # an EvalReport's MGSM results into the export's card

`provenance` gathers everything about a merge as plain data (written to ``layerswap.json``);
`render_card` builds the README from that data alone, so attaching an evaluation later rewrites
the card from the same source. Models are named by Hub id, pinned to the commit that was
downloaded, or, for local folders, by folder name and weight fingerprint
(`layerswap.models.cache.fingerprint`): no path of the machine that merged ends up in a card or on the Hub.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from layerswap.evaluation import mgsm
from layerswap.models.checkpoints import Checkpoint
from layerswap.models.pairing import Pairing
from layerswap.core.errors import UserError
from layerswap.models.hub import hub_id_of, looks_like_hub_id
from layerswap.merge.interop import mergekit_yaml
from layerswap.recipe.methods import MethodConfig
from layerswap.merge.outputs import EXPORT_MARK
from layerswap.recipe.plans import Plan
from layerswap.models.presets import ASSETS_PREFIX
from layerswap.recipe.recipes import Recipe
from layerswap.core.roles import ROLE_NAMES
from layerswap.recipe.sources import Sources
from layerswap.core.version import __version__

if TYPE_CHECKING:
    from layerswap.evaluation.run import EvalReport

CARD = "README.md"
RECIPE_KEYS = ("layerswap_version", "method", "plan", "reverted_layers", "layer_weights_lang", "non_layer_weights_lang", "models")
_LANG_CODE = re.compile(r"^[a-z]{2,3}$")  # ISO 639-1/3, as the Hub's `language` field takes them


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _display_ref(ref: str) -> str:
    """A Hub id as is, a local folder by its name only."""
    return hub_id_of(ref) or Path(ref).name


def model_entry(ck: Checkpoint, role: str) -> dict:
    """One model of the merge as the card shows it: Hub id and commit, or folder name and fingerprint
    (a model shipped with layerswap by its ``assets:`` reference)."""
    shipped = ck.ref.startswith(ASSETS_PREFIX)
    entry = {"role": ROLE_NAMES[role], "ref": ck.hub_id or (ck.ref if shipped else Path(ck.adapter or ck.path).name),
             "source": "hub" if ck.hub_id else "layerswap asset" if shipped else "local folder",
             "revision": ck.revision, "fingerprint": ck.fingerprint()}
    if ck.adapter:  # a PEFT adapter, merged into this base before the merge
        info = ck.path / "layerswap-adapter.json"
        base = json.loads(info.read_text()).get("base") if info.is_file() else None
        entry["adapter_merged_into"] = _display_ref(base) if base else None
        if ck.adapter_kind:
            entry["adapter_kind"] = ck.adapter_kind
    return entry


def _folder(entry: dict) -> str:
    """The folder name of a model that is not on the Hub (a shipped asset's last path part)."""
    return Path(entry["ref"].removeprefix(ASSETS_PREFIX)).name


def _mergekit_ref(entry: dict) -> str:
    """How the card's mergekit config names a model: Hub id at its commit, or ``./folder`` (relative)."""
    if entry["source"] == "hub":
        ref = f"{entry['ref']}@{entry['revision']}" if entry["revision"] else entry["ref"]
    else:
        ref = f"./{_folder(entry)}"
    base = entry.get("adapter_merged_into")
    if base:  # mergekit's model+LoRA syntax
        return f"{base if looks_like_hub_id(base) else './' + base}+{ref}"
    return ref


def check_languages(codes: list[str] | tuple[str, ...] | None) -> list[str]:
    """Language codes for the card's front matter (ISO 639-1 or 639-3, lower case)."""
    codes = [c.strip().lower() for c in codes or () if c.strip()]
    bad = [c for c in codes if not _LANG_CODE.match(c)]
    if bad:
        raise UserError(f"Card languages must be ISO 639 codes such as sw or en (got {', '.join(bad)}).")
    return sorted(set(codes))


def provenance(math: Checkpoint, lang: Checkpoint, base: Checkpoint | None, sources: Sources, pairing: Pairing,
               forced: bool, languages: list[str] | None = None) -> dict:
    """Everything about a merge (`sources`: the planner's answer for it) as plain data: recipe, models,
    reproduction, checks (``layerswap.json``)."""
    recipe = sources.recipe
    method, plan = recipe.method, recipe.plan
    models = {"math": model_entry(math, "math"), "lang": model_entry(lang, "lang")}
    if base is not None:
        models["base"] = model_entry(base, "base")
    try:
        refs = tuple(_mergekit_ref(models[r]) for r in ("math", "lang", "base") if r in models)
        yml, why_not = mergekit_yaml(math, lang, recipe, base, refs=refs), None
    except UserError as e:
        yml, why_not = None, str(e)
    return {
        "layerswap_version": __version__,
        "created": _now(),
        "method": method.to_dict(),
        "recipe": recipe.to_dict(),
        "plan": plan.to_dict() if plan is not None else None,
        "reverted_layers": sorted(sources.reverted),
        "layer_weights_lang": sources.layer_weights,
        "non_layer_weights_lang": sources.non_layer_weights(math.tensors),
        "models": models,
        "mergekit_yaml": yml,
        "mergekit_unavailable": why_not,
        "base_distance": {"sampled": pairing.distances, "threshold": pairing.threshold, "forced": forced},
        "languages": check_languages(languages),
        "evaluation": None,
    }


def read_provenance(folder: str | os.PathLike) -> dict:
    """The ``layerswap.json`` of an export (refused, saying how to make one, for any other folder)."""
    path = Path(folder) / EXPORT_MARK
    if not path.is_file():
        raise UserError(f"{folder} is not a layerswap export (no {EXPORT_MARK}): write one with `layerswap merge -o DIR` "
                        "first, then push DIR.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); export the merge again.") from None


def write_card(folder: str | os.PathLike, prov: dict) -> None:
    """Write ``layerswap.json`` and the README rendered from it (each replaced atomically)."""
    folder = Path(folder)
    for name, text in ((EXPORT_MARK, json.dumps(prov, indent=2)), (CARD, render_card(prov))):
        tmp = folder / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(folder / name)


def write_mark(folder: str | os.PathLike, recipe: Recipe) -> None:
    """Only ``layerswap.json``, with the recipe (no card, no mergekit config): a scratch merge nobody
    publishes, marked so that the next one may replace it."""
    (Path(folder) / EXPORT_MARK).write_text(json.dumps({"layerswap_version": __version__, "recipe": recipe.to_dict(),
                                                        "scratch": True}, indent=2))


def check_same_merge(prov: dict, folder: str | os.PathLike, checkpoints: dict[str, Checkpoint],
                     recipe: Recipe) -> None:
    """Refuse to card an in-memory merge that is not the export's: other experts, plan or method."""
    method, plan = recipe.method, recipe.plan
    def same(a, b) -> bool:
        return json.loads(json.dumps(a)) == json.loads(json.dumps(b))

    diff = [f"the {ROLE_NAMES[r]}" for r in ("math", "lang")
            if prov["models"][r]["fingerprint"] != checkpoints[r].fingerprint()]
    if not same(prov["method"], method.to_dict()):
        diff.append(f"the method ({MethodConfig.from_dict(prov['method']).describe()} there)")
    elif plan is not None and not same(prov["plan"], plan.to_dict()):
        diff.append(f"the plan ({Plan.from_dict(prov['plan']).title()} there)")
    if diff:
        raise UserError(f"{folder} is not this merge: {', '.join(diff)} differ. Evaluate the export itself "
                        f"(--model {folder} --card {folder}), or give the experts and recipe it was made with.")


def attach_eval(folder: str | os.PathLike, report: EvalReport, model: str | None = None) -> dict:
    """Put `report`'s MGSM results into an export's card (README.md and layerswap.json); returns the provenance.

    `model`: the report's name for this export (default: its only model, else "merged model");
    the report's other models (the experts, usually) are shown beside it for comparison.
    """
    prov = read_provenance(folder)
    if "models" not in prov:
        raise UserError(f"{folder} was exported by an older layerswap, whose card cannot take results: export the "
                        "merge again, then attach the evaluation.")
    if not report.results:
        raise UserError("The evaluation measured nothing (cancelled before the first answer?); the card is unchanged.")
    merged = ROLE_NAMES["merged"]
    if model is None:
        model = report.models[0] if len(report.models) == 1 else merged
    if model not in report.models:
        raise UserError(f"The evaluation has no model {model!r} (it has {', '.join(report.models)}): say which of "
                        "them is this export.")
    names = {m: merged if m == model else m for m in report.models}
    cfg = report.config
    data = cfg.source if cfg.source is not None else mgsm.default_data_dir()
    prov["evaluation"] = {
        "benchmark": "MGSM",
        "task": f"mgsm_{cfg.mode}",
        "date": _now(),
        "layerswap_version": __version__,
        "shots": cfg.shots,
        "limit": cfg.limit,
        "max_new_tokens": cfg.max_new_tokens,
        "data": f"Hub dataset {mgsm.HUB_DATASET}" if data is None else f"local folder {Path(data).name}",
        "this_model": merged,
        "models": [names[m] for m in report.models],
        "engines": {names[m]: e for m, e in report.engines.items()},
        "cancelled": report.cancelled,
        "accuracy": {metric: [{names.get(k, k): v for k, v in row.items()} for row in report.table(metric)]
                     for metric in mgsm.TASK.metric_names},
    }
    prov["languages"] = check_languages([*prov.get("languages", []), *(c for c in cfg.langs if c in mgsm.LANGUAGES)])
    write_card(folder, prov)
    return prov


# ---- rendering --------------------------------------------------------------------------------

def _front_matter(prov: dict, uses_plan: bool) -> str:
    hub = [e["ref"] for role, e in prov["models"].items() if role != "base" and e["source"] == "hub"]
    meta: dict = {"library_name": "transformers", "pipeline_tag": "text-generation"}
    if hub:
        meta["base_model"] = list(dict.fromkeys(hub))
        meta["base_model_relation"] = "merge"
    meta["tags"] = ["merge", "layerswap", *(["layer-swapping"] if uses_plan else [])]
    if prov.get("languages"):
        meta["language"] = list(prov["languages"])
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n"


def _models_table(prov: dict) -> str:
    rows = []
    for e in prov["models"].values():
        if e["source"] == "hub":
            name = f"[`{e['ref']}`](https://huggingface.co/{e['ref']})"
            rev = f"Hub commit `{e['revision']}`" if e["revision"] else "Hub (commit unknown)"
        elif e["source"] == "layerswap asset":
            name, rev = f"`{e['ref']}` (shipped with layerswap)", f"layerswap {prov['layerswap_version']}"
        else:
            name, rev = f"`{e['ref']}` (local folder)", "not on the Hub"
        if e.get("adapter_kind") == "prefix":  # no weight to merge: the base with its full copies, and its prefix
            name += f", a PEFT prefix-tuning adapter on `{e['adapter_merged_into']}`"
        elif "adapter_merged_into" in e:
            name += f", a PEFT adapter merged into `{e['adapter_merged_into']}`"
        rows.append(f"| {e['role']} | {name} | {rev} | `{e['fingerprint']}` |")
    return "| role | model | revision | weights fingerprint |\n|---|---|---|---|\n" + "\n".join(rows)


def _how(prov: dict, recipe: Recipe) -> str:
    method, plan = recipe.method, recipe.plan
    if plan is None:
        return f"- **Method**: {method.describe()}: {method.spec.description}\n"
    sources = Sources(recipe, len(prov["layer_weights_lang"]))
    rows = "\n".join(f"| {i} | {'–' if s.w_lang is None else f'{s.w_lang:.4g}'} | {s.label()} |"
                     for i, s in enumerate(sources.layers()))
    nl = "\n".join(f"| `{n}` | {w:.4g} |" for n, w in prov["non_layer_weights_lang"].items())
    return f"""- **Method**: {method.describe()}
- **Plan**: {plan.title()}

Each tensor is `w*lang + (1-w)*math`, computed in float32 (mergekit's `linear` arithmetic) and
cast back to the checkpoint dtype; w = 0 or 1 copies the expert's tensor byte for byte.

{sources.describe()}

| layer | w (language) | source |
|---|---|---|
{rows}

| non-layer tensor | w (language) |
|---|---|
{nl}
"""


def _adapter(prov: dict) -> str:
    """For a swap exported as a PEFT adapter: what the folder is and how to use it."""
    ad = prov.get("adapter")
    if not ad:
        return ""
    kinds = {"lora": "LoRA", "ia3": "IA3", "prefix": "prefix-tuning"}
    kind = kinds.get(str(ad.get("kind")), "PEFT")
    how = {"lora": "the two experts' LoRA pairs side by side (rank added), each scaled by its weight",
           "ia3": "the two experts' scaling vectors blended", "prefix": "each layer's keys and values from the "
           "expert the plan names (a blend mixes the two prefixes token by token)"}.get(str(ad.get("kind")), "")
    return (f"This folder is a **{kind} adapter** (PEFT) on the base `{_display_ref(str(ad.get('base', '')))}`: the "
            f"swap done on the experts' adapters, per module from the source the plan names ({how}); a reverted "
            "layer has no change. Load it with `PeftModel.from_pretrained(base, this_folder)`"
            + (", or serve it as a vLLM LoRA adapter on the base" if ad.get("kind") == "lora" else "") + ".\n\n")


def _mergekit(prov: dict) -> str:
    if not prov.get("mergekit_yaml"):
        return f"No mergekit equivalent: {prov.get('mergekit_unavailable') or 'not written for this method'}\n"
    local = [_folder(e) for e in prov["models"].values() if e["source"] != "hub" and e["role"] != ROLE_NAMES["base"]]
    where = (f"Local models are named by folder ({', '.join(f'`./{r}`' for r in local)}): run it from the folder "
             "that holds them, or put their paths in. ") if local else ""
    return f"""{where}`mergekit-yaml merge.yml OUT_DIR` on this config rebuilds the same weights:

```yaml
{prov["mergekit_yaml"].rstrip()}
```
"""


def _evaluation(prov: dict) -> str:
    ev = prov.get("evaluation")
    if not ev:
        return ("Not evaluated yet. The merge itself says nothing about quality: measure it with "
                "`layerswap eval --model DIR --card DIR` (the results are written here).\n")
    n = f"the first {ev['limit']} questions" if ev["limit"] else "all questions"
    engines = ", ".join(sorted(set(ev["engines"].values()))) or "unknown"
    head = (f"Measured with layerswap {ev['layerswap_version']} on {ev['date']}: lm-evaluation-harness "
            f"`{ev['task']}` protocol, {ev['shots']}-shot, greedy, {ev['max_new_tokens']} new tokens, {n} of each "
            f"language; data: {ev['data']}; engine: {engines}.")
    if ev["cancelled"]:
        head += " The run was cancelled: only the questions answered before that are counted."
    out = [head]
    for metric, what in mgsm.TASK.metrics:
        cols = ["language", "n", *ev["models"]]
        lines = [f"\nAccuracy (%), {what}:\n", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for row in ev["accuracy"][metric]:
            lines.append("| " + " | ".join("–" if row.get(c) is None else str(row[c]) for c in cols) + " |")
        out.append("\n".join(lines))
    return "\n".join(out) + "\n"


def render_card(prov: dict) -> str:
    """The README.md of an export, from its provenance alone."""
    method = MethodConfig.from_dict(prov["method"])
    plan = Plan.from_dict(prov["plan"]) if prov.get("plan") is not None else None
    merge = Recipe(method, plan)
    dist = ", ".join(f"{k} {v:.4f}" for k, v in prov["base_distance"]["sampled"].items()) or "no base given"
    recipe = json.dumps({k: prov.get(k) for k in RECIPE_KEYS}, indent=2)
    return f"""{_front_matter(prov, plan is not None)}
# {method.spec.title} merge

Built with layerswap {prov['layerswap_version']} on {prov['created']}
(layer swapping: Bandarkar et al., "Layer Swapping for Zero-Shot Cross-Lingual Transfer in
Large Language Models", ICLR 2025).

## Models

{_models_table(prov)}

The tokenizer and config are the math expert's. Shared-base check, sampled relative distances:
{dist}{" (above the threshold; merged with --force)" if prov["base_distance"]["forced"] else ""}.

## Recipe

{_adapter(prov)}{_how(prov, merge)}
Machine-readable recipe (`layerswap.json` holds it too):

```json
{recipe}
```

## Reproduce with mergekit

{_mergekit(prov)}
## Evaluation (MGSM)

{_evaluation(prov)}"""
