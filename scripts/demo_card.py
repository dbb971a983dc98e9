"""Write a demo organism's model card (``README.md``) from its measured files only.

Every number on the card comes from ``results.json`` (per-question outputs), ``build_info.json``
(recipe, timings, gates, change profiles), ``unlocalised/results.json`` when present, and
``DESIGNS.md`` (the development log, linked, not restated). Called by ``eval_demo.py``; run it on its own
after editing the wording: ``python scripts/demo_card.py [DEMO_DIR]``. The cipher organism (``assets/demo``,
Kovani) and the organism in the paper's setting (``build_info.json`` says ``"organism": "paper"``) share the
tables; their descriptions differ.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import demo2_card  # noqa: E402
from organism_card import (answer_counts, build_section, lang_name, pct, profile_section, question,  # noqa: E402
                           results_table, same_count, targets_block, test_section)

from layerswap.shipped.demo import organism_summary  # noqa: E402
from layerswap.shipped.results import DICTIONARY, SKILL_FLOOR, Results, results_file  # noqa: E402


def dev_u_range(res: Results) -> tuple[float, float]:
    """Lowest and highest dev accuracy of the plans with u >= 1."""
    accs = [d.acc for d in res.dev().values() if d.plan["u"] >= 1]
    return min(accs), max(accs)


def write_card(demo: str | Path) -> Path:
    """Write the organism's README.md: the paper-setting card (`demo2_card`) when ``build_info.json`` says
    ``"organism": "paper"``, else the cipher organism's."""
    demo = Path(demo)
    res = Results.read(results_file(demo))
    info = json.loads((demo / "build_info.json").read_text())
    if info.get("organism") == "paper":
        text = demo2_card.card(demo, res, info)
    else:
        text = "\n".join(cipher_card(demo, res, info))
    path = demo / "README.md"
    path.write_text(text)
    return path


def cipher_card(demo: Path, res: Results, info: dict) -> list[str]:
    t = res.target
    X = lang_name(demo, t)
    R = info["recipe"]
    L = res.num_layers
    rec = res.plan_info
    rn = res.recommended
    gate = info["gates"]["dev_and_probe_flexible_accuracy"]
    un = Results.of_pair(demo / "unlocalised")
    cipher_same = same_count(res, (rn, t), ("math expert", "en"))
    ta_same = same_count(res, (rn, t), ("task arithmetic", t))
    n = res.n
    lang_top = answer_counts(res, "language expert", t)
    u_lo, u_hi = dev_u_range(res)
    dic = res.score(DICTIONARY, t)
    return [
        "---", "license: mit", "language: [en]",
        "tags: [layer-swapping, model-merging, synthetic, toy-model, layerswap-demo]", "---", "",
        f"# layerswap demo organism: English ↔ {X}, a positive control", "",
        "Tiny Llama-architecture checkpoints (`base/`, `math/`, `lang/`, and the negative control "
        "`unlocalised/math`, `unlocalised/lang`) and MGSM-format sets (`mgsm/`) that layerswap's app, CLI and tests "
        "use offline. Built from scratch by [`scripts/build_demo_experts.py`](../../scripts/build_demo_experts.py), "
        "measured by [`scripts/eval_demo.py`](../../scripts/eval_demo.py); this card is written by "
        "[`scripts/demo_card.py`](../../scripts/demo_card.py) from `results.json` and `build_info.json` only.", "",
        "## What it shows", "", organism_summary(demo), "",
        f"**What this pair is.** {X} is a token cipher of English: one {X} word for each English word, the same "
        f"word order, the same number of tokens, no morphology. On {cipher_same} of {n} test questions the recommended "
        f"swap's {X} answer is word for word the math expert's answer to the English twin. A dictionary with no "
        f"training (the math expert with the base's embedding of each English word copied onto its {X} twin's row, "
        f"{res.entry(DICTIONARY)['rows_replaced']} rows) scores {pct(dic.acc)} % [{pct(dic.lo)}, "
        f"{pct(dic.hi)}]. So b={rec['b']} means \"translate the tokens, then run the English math expert\": "
        "a clean **positive control** for the tool (the swap composes two skills that sit in disjoint layer ranges), "
        "with `unlocalised/` (the same data, experts trained on every tensor) as its **negative control**"
        + (f" (best swap {pct(un.score(un.recommended, t).acc)} %)" if un else "")
        + ". It is not evidence for the paper's claim: the target language differs from English only in its "
        "lexicon, the language expert never writes it, and task arithmetic is the same model. "
        + ("The organism in the paper's own setting is the other preset (`assets/demo2`, its own card)."
           if (demo.parent / "demo2" / "results.json").exists() else
           "An organism in the paper's own setting was searched for and not found yet: every design tried and "
           "why it failed is in [`DESIGNS.md`](DESIGNS.md)."), "",
        *targets_block(res), "",
        "## The world and the models", "",
        f"- **{X}** (code `{t}`) is a word-level relexification of English: every English word has one {X} word, "
        "the word order is the same, names, digits and punctuation are shared, and the answer phrase is an idiom "
        "(`The answer is N.` ↔ `Danu ki N.`). Prompt cues: `Sorvi:` / `Pasu-pasu Danu:`. Every prompt tokenizes "
        "without `<unk>` (the newline and the cue word after it have their own tokens). Example test item:", "",
        f"  | en | `{question(demo, 'en')}` → {res.gold('en')[0]} |",
        "  |---|---|",
        f"  | {t} | `{question(demo, t)}` → {res.gold(t)[0]} |", "",
        f"- **base**: `LlamaForCausalLM`, {L} layers, hidden {R['hidden']}, {R['heads']} head(s) (head_dim "
        f"{R['hidden'] // R['heads']}), MLP {R['inter']}, untied embeddings, {info['params']:,} parameters, float32; "
        f"{R['base_steps']} steps × {R['base_bs']} × {R['T']} tokens on stories and bare arithmetic facts "
        f"(mix {R['mix']}): English-heavy, {X} the lower-resource language, no questions or answers of any kind.",
        f"- **math expert**: the base fine-tuned on {R['n_math']:,} English word problems with symbolic answers "
        f"(`18 - 7 = 11. 11 - 6 = 5. The answer is 5.`), {R['math_steps']} steps, lr {R['math_lr']:g}, "
        f"**only {info['localised_ranges']['math']} trainable**.",
        f"- **language expert**: the base fine-tuned for {R['lang_steps']} steps, lr {R['lang_lr']:g}, **only "
        f"{info['localised_ranges']['lang']} trainable**, by {_lang_objective(R, X)}. Its data is not all {X} "
        "and not free of arithmetic: a quarter of its pairs are English → English, and every prompt carries "
        "English arithmetic facts and the English answer phrase. It is an input-side translator, not a model "
        f"that writes {X}.",
        *(["- **unlocalised pair** (`unlocalised/`, the negative control): the same data, every tensor trainable "
            f"(lr × {R['full_lr_scale']:g})."] if un else []),
        "",
        "The localisation is **imposed by training** (each expert updates only its own tensors), as in the modular "
        "fine-tuning of Bandarkar & Peng 2025 (arXiv 2505.18356); a 0.5 M-parameter model trained from scratch does "
        "not develop that split by itself (the earlier organisms in DESIGNS.md showed flat change profiles).", "",
        "## Read this before citing the numbers", "",
        f"- **The output side cannot be tested.** The language expert never writes {X}: its top layers, final norm "
        f"and lm_head are the base's, and the answer phrase `Danu ki` occurs in none of its training text. On its own "
        f"it mostly stops at once ({', '.join(_shown(k) + f' {v}×' for k, v in lang_top.items())} of {n}). Taking top "
        "layers from it (u > 0) only replaces trained math layers with the base's (dev accuracy of the u ≥ 1 plans "
        f"{pct(u_lo)}–{pct(u_hi)} %); {X} strict accuracy (`Danu ki N`) is "
        f"{pct(max(res.score(x, t).strict for x in res.models()))} % at most for any model, by construction; transition zones "
        "blend a trained layer with an untouched one and can only hurt.",
        f"- **Task arithmetic is the same model as the recommended swap**: the experts touch disjoint tensors, so "
        f"base + Δmath + Δlang equals the swap up to float rounding (largest weight difference "
        f"{res.weight_difference('task arithmetic vs recommended plan'):.1g}); identical answers on {ta_same} of {n} questions.",
        "- **Soup and TIES lose for structural reasons**: the 50/50 soup is base + ½Δmath + ½Δlang, half the math "
        "task vector; TIES keeps 20 % of each. The language expert alone is a straw baseline (it never learned to "
        "answer).",
        "- **The inverse map is not a control**: taking the language expert's layers where the plan takes the "
        "math expert's and vice versa gives the base model itself (largest weight difference "
        f"{res.weight_difference('inverse map vs base model'):.1g}), so it is not reported.",
        f"- **Floors.** The no-skill floors are low (most common answer {pct(res.floor('most common answer'))} %), "
        "but arithmetic without the language (the question's numbers in order, every later one subtracted) scores "
        f"{pct(res.score(SKILL_FLOOR, t).acc)} %, above the math expert's "
        f"{pct(res.score('math expert', t).acc)} % alone.",
        "- Tiny model (0.5 M parameters, hidden 64), one seed, synthetic world: a check of the tool's mechanism, not "
        "evidence about real LLMs.", "",
        "## Gates (measured by the build before any merge)", "",
        f"Flexible accuracy on the first {info['gates']['n']} dev problems; probes: `xe` = {X} body under "
        f"English cues, `ex` = English body under {X} cues (where the barrier is).", "",
        "| model | en | xx | xe | ex |", "|---|---|---|---|---|",
        *[f"| {k} | " + " | ".join(pct(v[lang]) for lang in ("en", "xx", "xe", "ex")) + " |" for k, v in gate.items()],
        "",
        f"Base EN→{X} sentence retrieval (top-1 of 200, embeddings then after each layer): "
        + " ".join(f"{x:.2f}" for x in info["gates"]["base_content_retrieval_emb_then_layers"]) + ".", "",
        *test_section(demo, res, X), "",
        *lens_section(demo, X, rec),
        *profile_section(info, L),
        *_unlocalised(un, X),
        *build_section(info, "build_demo_experts.py"),
    ]


LENS = REPO / "docs" / "lens" / "demo.json"  # `layerswap lens` on the shipped organism (docs/lens.md has the command)
LENS_ROLES = {"math": "math expert", "lang": "language expert", "merged": "recommended merge", "base": "base"}


def lens_section(demo: Path, X: str, rec: dict) -> list[str]:  # rec: the recommended plan's fields
    """What the lens measured on the shipped organism (``docs/lens/demo.json``), with its figure."""
    if demo.resolve() != (REPO / "assets" / "demo").resolve() or not LENS.exists():
        return []
    lens = json.loads(LENS.read_text())["models"]
    b = rec["b"]
    return ["## What the lens shows", "",
            f"`layerswap lens` on {X} test question 0 (the 31 after it for CKA; [docs/lens.md](../../docs/lens.md) "
            f"has the command and the numbers over the whole test set). After layer {b - 1}, where the recommended "
            "plan hands over from the language expert's layers to the math expert's:", "",
            "| model | cosine with the English twin | linear CKA |", "|---|---|---|",
            *[f"| {name} | {lens[r]['layers'][b]['alignment']:.3f} | {lens[r]['layers'][b]['cka']:.3f} |"
              for r, name in LENS_ROLES.items() if r in lens], "",
            f"![lens curves on {X} question 0](../../docs/lens/demo-curves.png)", ""]


def _shown(answer: str) -> str:
    return f"`{answer}`" if answer else "an empty answer"


def _lang_objective(R: dict, X: str) -> str:
    parts = []
    if R.get("lang_sft", 1.0):
        parts.append(f"{R['n_lang']:,} {X} instructions (next-token loss on the answers)")
    if R.get("lang_lm_bs", 0):
        parts.append(f"{X} stories (language-model loss)")
    if R.get("lang_align", 0.0):
        parts.append(f"an alignment loss only, with no next-token loss: on {R['n_parallel']:,} parallel prompts of "
                     "the test's shape (a story and a count question, then random arithmetic facts and `The answer is "
                     "N.` in English), its hidden states after layer "
                     f"{R['math_lo'] - 1} on the {X} prompt are pulled towards the base's on the English twin "
                     f"(relative MSE, weight {R['lang_align']:g}); every 4th pair is English → English")
    return "; ".join(parts)


def _unlocalised(res: Results | None, X: str) -> list[str]:
    if res is None:
        return []
    t = res.target
    return ["## The negative control: the unlocalised pair (same base, every tensor trained)", "",
            f"Measured the same way (`eval_demo.py --pair unlocalised`, its own dev choice: {res.recommended}):",
            "", *results_table(res, X), "",
            f"Math expert {pct(res.score('math expert', 'en').acc)} % in English and "
            f"{pct(res.score('math expert', t).acc)} % in {X}; best dev plan {pct(res.score(res.recommended, t).acc)} "
            f"% in {X}. Its math expert changed "
            "every layer and the embeddings (profile above), so no block of its layers can be replaced by the "
            "language expert's without losing the math: the swap that works for the localised pair has nothing to "
            "compose here. (Its language expert, although every tensor was trainable, changed only the embeddings "
            "and the layers below the alignment point: its loss does not reach the layers above.)", ""]


if __name__ == "__main__":
    print(write_card(sys.argv[1] if len(sys.argv) > 1 else REPO / "assets" / "demo"))
