"""The model card of the demo organism in the paper's setting (English ↔ Oruki, ``assets/demo2``), from its
measured files only: ``results.json`` (the frozen-range language expert), ``results_lang_revert.json`` (the
one trained fully, then reverted) and ``build_info.json``. `demo_card.write_card` calls `card`.
"""

from __future__ import annotations

import json
from pathlib import Path

import demo_card as C

from layerswap.demo import organism_summary


def card(demo: Path, res: dict, info: dict) -> str:
    t = res["target_language"]
    X = C.lang_name(demo, t)
    R = info["recipe"]
    L = res["num_layers"]
    m = res["models"]
    rn = res["recommended_name"]
    rev_file = demo / "results_lang_revert.json"
    rev = json.loads(rev_file.read_text()) if rev_file.exists() else None
    gate = info["gates"]["dev_flexible_and_strict"]
    lines = [
        "---", "license: mit", "language: [en]",
        "tags: [layer-swapping, model-merging, synthetic, toy-model, layerswap-demo]", "---", "",
        f"# layerswap demo organism: English ↔ {X}, in the paper's setting", "",
        "Tiny Llama-architecture checkpoints (`base/`, `math/`, `lang/`, `lang_revert/`) and MGSM-format sets "
        "(`mgsm/`) that layerswap's app, CLI and tests use offline. Built from scratch by "
        "[`scripts/build_demo2.py`](../../scripts/build_demo2.py), measured by "
        "[`scripts/eval_demo.py`](../../scripts/eval_demo.py); this card is written by "
        "[`scripts/demo2_card.py`](../../scripts/demo2_card.py) from `results.json`, `results_lang_revert.json` and "
        "`build_info.json` only.", "",
        "## What it shows", "", organism_summary(demo), "",
        *C.targets_block(res), "",
        *_verdict(res, X), "",
        "## The world and the models", "",
        f"- **{X}** (code `{t}`) shares the world of the English stories (the same cast, objects and word "
        "problems) but not English's grammar: clauses are verb-final, numbers and adjectives follow their noun, "
        "nouns take a plural suffix unless their number is 1, case suffixes replace prepositions (`-ne` to, `-bo` "
        "in, `-sa` with, `-ke` into a colour) and verbs agree with their subject's noun class (`-a` / `-o`). Names "
        "and digits are shared. The answer phrase is `Danu N ki.` (strict extraction reads it). Example test item:",
        "",
        f"  | en | `{C._question(demo, 'en')}` → {res['gold']['en'][0]} |",
        "  |---|---|",
        f"  | {t} | `{C._question(demo, t)}` → {res['gold'][t][0]} |", "",
        f"- **base**: `LlamaForCausalLM`, {L} layers, hidden {R['hidden']}, {R['heads']} head(s) (head_dim "
        f"{R['hidden'] // R['heads']}), MLP {R['inter']}, untied embeddings, {info['params']:,} parameters, float32; "
        f"{R['base_steps']} steps × {R['base_bs']} × {R['T']} tokens, mix {R['mix']}: English stories, fewer {X} "
        f"stories, stories that switch language from sentence to sentence (`mixed`), bare arithmetic facts and "
        "generic English instructions with their answers (`qa_en`: how many / where / who / what colour / what, "
        "answered from the text, and retelling; `… The answer is X.`). No word problems, nothing in "
        f"{X} with a question.",
        f"- **math expert**: the base fine-tuned by next-token SFT (loss on the answer) on {R['n_math']:,} English "
        f"word problems with symbolic answers, {R['math_steps']} steps, lr {R['math_lr']:g}, **only "
        f"{info['localised_ranges']['math']} trainable**.",
        f"- **language expert** (`lang/`): the base fine-tuned by ordinary next-token SFT (loss on the "
        f"{'instruction and the answer' if R['lang_prompt_loss'] else 'answer'}) on {R['n_lang']:,} generic {X} "
        f"instructions with {X} answers (the kinds of `qa_en`, in {X}; no arithmetic, no word problems), "
        f"{R['lang_steps']} steps, lr {R['lang_lr']:g}, **only {info['localised_ranges']['lang']} trainable**.",
        f"- **language expert, trained fully then reverted** (`lang_revert/`): the same data and steps, every tensor "
        f"trainable (lr × {R['full_lr_scale']:g}), then every tensor outside the language range set back to the "
        "base's (Bandarkar & Peng 2025 compare the two).", "",
        "The localisation is **imposed by training** (each expert updates only its own layers), as in the modular "
        "fine-tuning of Bandarkar & Peng 2025 (arXiv 2505.18356); what the organism tests is whether the swap then "
        f"composes English maths with {X} reading and writing that were never trained together.", "",
        "## Gates (measured by the build before any merge)", "",
        f"Accuracy on the first {info['gates']['n']} dev problems, flexible / strict:", "",
        f"| model | en | {t} |", "|---|---|---|",
        *[f"| {k} | {C.pct(v['en flexible'])} / {C.pct(v['en strict'])} | {C.pct(v[f'{t} flexible'])} / "
          f"{C.pct(v[f'{t} strict'])} |" for k, v in gate.items()], "",
        *C.test_section(demo, res, X), "",
        *_output_side(res), "",
        *_revert(rev, res, X), "",
        *C.profile_section(info, L),
        *C.build_section(info, "build_demo2.py"),
    ]
    return "\n".join(lines)


def _verdict(res: dict, X: str) -> list[str]:
    t = res["target_language"]
    m, rn = res["models"], res["recommended_name"]
    return [f"The recommended plan ({res['recommended_plan']['name']}) scores {C.pct(m[rn][t]['acc'])} % flexible and "
            f"{C.pct(m[rn][t]['strict'])} % strict in {X}; the math expert {C.pct(m['math expert'][t]['acc'])} % "
            f"({C.pct(m['math expert']['en']['acc'])} % in English), the dictionary baseline "
            f"{C.pct(m['dictionary baseline'][t]['acc'])} %. Task arithmetic (base + Δmath + Δlang) is a different "
            f"model here only where the experts' ranges overlap; they do not, so it adds the same deltas "
            f"(largest weight difference to the plan {res['max_abs_weight_difference']['task arithmetic vs recommended plan']:.1g})."]


def _output_side(res: dict) -> list[str]:
    """The dev grid: what the top layers from the language expert (u) do."""
    rows = sorted(res["dev_grid"].items(), key=lambda kv: (kv[1]["plan"]["u"], kv[1]["plan"]["b"],
                                                           kv[1]["plan"]["tb"]))
    return ["## The output side (dev set, every plan of the grid)", "",
            "Flexible / strict accuracy on the dev questions the plan was chosen on; u = top layers from the language "
            "expert:", "", "| plan | flexible | strict |", "|---|---|---|",
            *[f"| {name} | {C.pct(d['acc'])} | {C.pct(d['strict'])} |" for name, d in rows]]


def _revert(rev: dict | None, res: dict, X: str) -> list[str]:
    if rev is None:
        return []
    t = rev["target_language"]
    return ["## Language expert trained fully, then reverted", "",
            f"Measured the same way with `lang_revert/` as the language expert (`eval_demo.py --lang lang_revert`, its "
            f"own dev choice: {rev['recommended_name']}):", "", *C.results_table(rev, X), "",
            *C.targets_block(rev), ""]
