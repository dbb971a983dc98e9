"""Write the demo organism's model card (``assets/demo/README.md``) from its measured files only.

Every number on the card comes from ``results.json`` (per-question outputs), ``build_info.json``
(recipe, timings, gates, change profiles), ``unlocalised/results.json`` when present, and
``DESIGNS.md`` (the development log, linked, not restated). Called by ``eval_demo.py``; run it on its own
after editing the wording: ``python scripts/demo_card.py [DEMO_DIR]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from layerswap.demo import organism_summary

ORDER = ["base model", "math expert", "language expert", "soup 50/50", "TIES (density 0.2)", "task arithmetic"]


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def results_table(res: dict) -> list[str]:
    t = res["target_language"]
    names = [n for n in ORDER if n in res["models"]] + [n for n in res["models"] if n not in ORDER]
    lines = ["| model | Kovani flexible [95 % CI] | Kovani strict | English flexible [95 % CI] | English strict |",
             "|---|---|---|---|---|"]
    for n in names:
        m = res["models"][n]
        cells = [f"{pct(m[lang]['acc'])} [{pct(m[lang]['ci95'][0])}, {pct(m[lang]['ci95'][1])}] | "
                 f"{pct(m[lang]['strict'])}" if lang in m else "– | –" for lang in (t, "en")]
        label = f"**{n}**" if n == res["recommended_name"] else n
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def sample_outputs(res: dict, index: int = 0) -> list[str]:
    t = res["target_language"]
    lines = []
    for n in ["math expert", "language expert", res["recommended_name"], "soup 50/50"]:
        for lang in (t, "en"):
            if lang not in res["outputs"][n]:
                continue
            o = res["outputs"][n][lang]
            ok = "correct" if o["correct"][index] == "1" else "wrong"
            lines.append(f"- {n}, {'Kovani' if lang == t else 'English'}: `{o['output'][index].strip()}` ({ok})")
    return lines


def write_card(demo: str | Path) -> Path:
    demo = Path(demo)
    res = json.loads((demo / "results.json").read_text())
    info = json.loads((demo / "build_info.json").read_text())
    t = res["target_language"]
    R = info["recipe"]
    L = res["num_layers"]
    rec = res["recommended_plan"]
    gate = info["gates"]["dev_and_probe_flexible_accuracy"]
    met = res["targets_met"]
    head = ("**The organism meets its targets.**" if met else
            "**The organism does not meet all of its targets** (see the checklist below): it is shipped as the best "
            "one found, and the card says where it falls short.")
    lines = [
        "---", "license: mit", "language: [en]",
        "tags: [layer-swapping, model-merging, synthetic, toy-model, layerswap-demo]", "---", "",
        "# layerswap demo organism: English ↔ Kovani", "",
        "Tiny Llama-architecture checkpoints (`base/`, `math/`, `lang/`, and the unconstrained pair "
        "`unlocalised/math`, `unlocalised/lang`) and MGSM-format sets (`mgsm/`) that layerswap's app, CLI and tests "
        "use offline. Built from scratch by [`scripts/build_demo_experts.py`](../../scripts/build_demo_experts.py), "
        "measured by [`scripts/eval_demo.py`](../../scripts/eval_demo.py); this card is written by "
        "[`scripts/demo_card.py`](../../scripts/demo_card.py) from `results.json` and `build_info.json` only.", "",
        "## What it shows", "", organism_summary(demo), "", head, "",
        "| target | met |", "|---|---|",
        *[f"| {k} | {'yes' if v else '**no**'} |" for k, v in res["targets"].items()], "",
        "## The world and the models", "",
        "- **Kovani** (code `xx`) is a word-level relexification of English: every English word has one Kovani word, "
        "the word order is the same, names, digits and punctuation are shared, and the answer phrase is an idiom "
        "(`The answer is N.` ↔ `Danu ki N.`). Prompt cues: `Sorvi:` / `Pasu-pasu Danu:`. Example test item:", "",
        f"  | en | `{_question(demo, 'en')}` → {res['gold']['en'][0]} |",
        "  |---|---|",
        f"  | xx | `{_question(demo, t)}` → {res['gold'][t][0]} |", "",
        f"- **base**: `LlamaForCausalLM`, {L} layers, hidden {R['hidden']}, {R['heads']} head(s) (head_dim "
        f"{R['hidden'] // R['heads']}), MLP {R['inter']}, untied embeddings, {info['params']:,} parameters, float32; "
        f"{R['base_steps']} steps × {R['base_bs']} × {R['T']} tokens on stories and bare arithmetic facts "
        f"(mix {R['mix']}): English-heavy, Kovani the lower-resource language, no questions or answers of any kind.",
        f"- **math expert**: the base fine-tuned on {R['n_math']:,} English word problems with symbolic answers "
        f"(`18 - 7 = 11. 11 - 6 = 5. The answer is 5.`), {R['math_steps']} steps, lr {R['math_lr']:g}, "
        f"**only {info['localised_ranges']['math']} trainable**.",
        f"- **language expert**: the base fine-tuned for {R['lang_steps']} steps, lr {R['lang_lr']:g}, **only "
        f"{info['localised_ranges']['lang']} trainable**, on Kovani only: " + _lang_objective(R) + ". No arithmetic.",
        *(["- **unlocalised pair** (`unlocalised/`): the same data, every tensor trainable "
            f"(lr × {R['full_lr_scale']:g}); the premise of layer swapping does not hold for it by construction."]
          if (demo / "unlocalised").exists() else []),
        "",
        "The localisation is **imposed by training, not emergent**. That is a faithful setting of the method: "
        "Bandarkar & Peng 2025 (arXiv 2505.18356) find math and language parameters largely non-overlapping in "
        "real LLMs, assign them to layers by modular fine-tuning (freezing) or post-hoc reverting, and find layer "
        "swapping of separately trained experts the most consistent merge. A 0.5 M-parameter model trained from "
        "scratch does not develop that split by itself (the previous organism showed flat change profiles), so "
        "this organism builds it in and asks whether the swap then composes the two skills.", "",
        "## Read this before citing the numbers", "",
        "- The language expert is an **input-side translator**, not a Kovani chatbot: it changes only the embeddings "
        "and the bottom layers, and was trained to make Kovani prompts read, at the boundary to the layers above, "
        "like their English twins. Its alignment prompts have the test's shape (a story and the question "
        "`How many X does P have (now)?`, never an answer) and continue with random arithmetic facts unrelated to "
        "the story, so generated tokens read as after an English prompt. That is strong, explicit supervision; "
        "the organism shows that a swap composes two localised skills, not that alignment emerges.",
        "- On its own the language expert answers with an empty string (the base never learned to answer), and the "
        "merged model answers in the math expert's **English** format (`The answer is N.`): Kovani strict accuracy "
        f"(`Danu ki N`) is at most {pct(max(m[t]['strict'] for m in res['models'].values()))} % for any model. Taking the top layers from the language expert as well (the paper's "
        "u > 0) did not work in this small model (run E1 in DESIGNS.md), so the recommended plan has u = 0.",
        "- The two experts touch disjoint tensors, so task arithmetic (λ = 1) is the same model as the recommended "
        "swap (identical answers, paired difference 0); soup and TIES fail because they scale or trim each task "
        "vector.",
        "- Tiny model (0.5 M parameters, hidden 64), one seed, synthetic world: a demonstration of the mechanism "
        "for the app, not evidence about real LLMs.", "",
        "## Gates (measured by the build before any merge)", "",
        f"Flexible accuracy on the first {info['gates']['n']} dev problems; probes: `xe` = Kovani body under "
        "English cues, `ex` = English body under Kovani cues (where the barrier is).", "",
        "| model | en | xx | xe | ex |", "|---|---|---|---|---|",
        *[f"| {k} | " + " | ".join(pct(v[lang]) for lang in ("en", "xx", "xe", "ex")) + " |" for k, v in gate.items()],
        "",
        "Base EN→Kovani sentence retrieval (top-1 of 200, embeddings then after each layer): "
        + " ".join(f"{x:.2f}" for x in info["gates"]["base_content_retrieval_emb_then_layers"]) + ".", "",
        "## Results on the test sets", "",
        f"n = {res['questions_per_language']} per language (the same problems in both), never used for training or "
        f"choice. Protocol: `mgsm_native_cot` 0-shot, greedy, at most {res['protocol']['max_new_tokens']} new tokens, "
        "flexible = last number of the answer. Merges are layerswap's own (`Workbench.build`). English is measured "
        f"for {', '.join(res['english_measured_for'])} (– elsewhere, to keep the evaluation within its time budget).",
        "",
        *results_table(res), "",
        f"The **recommended plan** ({rec['name']}: b={rec['b']}, u={rec['u']}, tb={rec['tb']}, tu={rec['tu']}, "
        f"{rec['transition']} {rec['transition_weight']}, non-layer {rec['non_layer']}) was chosen on the dev set "
        f"only ({rec['chosen_on']}, dev accuracy {pct(rec['dev_accuracy'])} %) and is in `recommended_plan.json`; "
        "the app preselects it. The inverse map takes the language expert's layers where the plan takes the math "
        "expert's and vice versa. The base model is task arithmetic with λ = 0.", "",
        "Paired per-question differences on Kovani, recommended plan minus each model (points ± one SE, z):", "",
        "| model | difference | z |", "|---|---|---|",
        *[f"| {n} | {100 * c['diff']:+.1f} ± {100 * c['se']:.1f} | {c['z']} |"
          for n, c in res["paired_recommended_minus"].items()], "",
        "Floors on Kovani (no skill needed): " + "; ".join(f"{k} {pct(v)} %"
                                                         for k, v in res["floors_target_language"].items()) + ".",
        "", "Answers to test item 0 (all outputs are in `results.json`):", "", *sample_outputs(res), "",
        "## Where the experts changed", "",
        "Relative change ‖Δ‖/‖θ_base‖ in percent, by layer (bottom to top), then embeddings, final norm, lm_head:", "",
        "| expert | " + " | ".join(f"L{i}" for i in range(L)) + " | emb | norm | head |",
        "|---|" + "---|" * (L + 3),
        *_profile_rows(info, "change_profile", ""), *_profile_rows(info, "change_profile_unlocalised", "unlocalised "),
        "", *_unlocalised(demo),
        "## Build", "",
        f"`python scripts/build_demo_experts.py` (seed {info['seed']}, {info['threads']} thread(s), deterministic): "
        f"{info['seconds']['total']} s on the build machine ({', '.join(f'{k} {v} s' for k, v in info['seconds'].items() if k != 'total')}). "
        + (f"The shipped files reused the base (pretrained in {info['seconds'].get('base_pretraining_in_reused_build')} s) "
           f"and experts {sorted(info.get('experts_reused_from') or {})} of earlier runs of the same recipe "
           "(`--reuse-base`, `--reuse-experts`); the slow test rebuilds everything from scratch and compares "
           "weights by sha256. " if info.get("base_reused_from") else "") +
        (f"Measured {info['measured_on']}. " if info.get("measured_on") else "") +
        "`python3 scripts/dev.py test -m slow` rebuilds it from scratch, checks every weight file by sha256 and "
        "re-measures it. `python scripts/eval_demo.py` then measures it and rewrites this card. Every design tried on the way, with "
        "its numbers, is in [`DESIGNS.md`](DESIGNS.md).", "",
    ]
    path = demo / "README.md"
    path.write_text("\n".join(lines))
    return path


def _lang_objective(R: dict) -> str:
    parts = []
    if R.get("lang_sft", 1.0):
        parts.append(f"{R['n_lang']:,} Kovani instructions (retell and count, ending `Danu ki N.`; where/who/colour/"
                     "what; retelling; translation into Kovani)")
    if R.get("lang_lm_bs", 0):
        parts.append("Kovani stories (language-model loss)")
    if R.get("lang_align", 0.0):
        parts.append(f"an alignment loss on {R['n_parallel']:,} word-for-word parallel prompts (a story and a count "
                     f"question, no answer): the expert's hidden states after layer {R['math_lo'] - 1} on the Kovani "
                     "prompt are pulled towards the base's on the English twin (relative MSE, weight "
                     f"{R['lang_align']:g}), i.e. the expert learns to map Kovani into what the layers above already read")
    return "; ".join(parts)


def _question(demo: Path, lang: str) -> str:
    return (demo / "mgsm" / f"mgsm_{lang}.tsv").read_text(encoding="utf-8").splitlines()[0].split("\t")[0]


def _profile_rows(info: dict, key: str, prefix: str) -> list[str]:
    if key not in info:
        return []
    out = []
    for role, name in (("math", "math expert"), ("lang", "language expert")):
        p = info[key][role]
        out.append(f"| {prefix}{name} | " + " | ".join(f"{100 * x:.1f}" for x in p["layers"] + [p["emb"], p["norm"],
                                                                                               p["head"]]) + " |")
    return out


def _unlocalised(demo: Path) -> list[str]:
    f = demo / "unlocalised" / "results.json"
    if not f.exists():
        return []
    res = json.loads(f.read_text())
    t = res["target_language"]
    m = res["models"]
    return ["## The unlocalised pair (same base, every tensor trained)", "",
            f"Measured the same way (`eval_demo.py --pair unlocalised`, its own dev choice: {res['recommended_name']}):",
            "", *results_table(res), "",
            f"Math expert {pct(m['math expert']['en']['acc'])} % in English and {pct(m['math expert'][t]['acc'])} % "
            f"in Kovani; best dev plan {pct(m[res['recommended_name']][t]['acc'])} % in Kovani. Its math expert changed "
            "every layer and the embeddings (profile above), so no block of its layers can be replaced by the "
            "language expert's without losing the math: the swap that works for the localised pair has nothing to "
            "compose here. (Its language expert, although every tensor was trainable, changed only the embeddings "
            "and the layers below the alignment point: its loss does not reach the layers above.)", ""]


if __name__ == "__main__":
    print(write_card(sys.argv[1] if len(sys.argv) > 1 else REPO / "assets" / "demo"))
