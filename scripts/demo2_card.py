"""The model card of the demo organism in the paper's setting (English ↔ Oruki, ``assets/demo2``), from its
measured files only: ``results.json`` (the frozen-range language expert), ``results_lang_revert.json`` (the
one trained fully, then reverted) and ``build_info.json``. `demo_card.write_card` calls `card`; the shared parts
are `organism_card`'s.
"""

from __future__ import annotations

from pathlib import Path

import organism_card as C

from layerswap.shipped.demo import organism_summary
from layerswap.shipped.results import DICTIONARY, SAME_WEIGHTS, Results


def card(demo: Path, res: Results, info: dict) -> str:
    t = res.target
    X = C.lang_name(demo, t)
    R = info["recipe"]
    L = res.num_layers
    rev = Results.of_pair(demo, "lang_revert")
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
        f"problems) but not English's grammar: clauses are {'verb-final' if R.get('verb_final', True) else 'subject-verb-object'}, numbers and adjectives follow their noun, "
        "nouns take a plural suffix unless their number is 1, case suffixes replace prepositions (`-ne` to, `-bo` "
        "in, `-sa` with, `-ke` into a colour) and verbs agree with their subject's noun class (`-a` / `-o`). Names "
        "and digits are shared. The answer phrase is `Danu N ki.` (strict extraction reads it). Example test item:",
        "",
        f"  | en | `{C.question(demo, 'en')}` → {res.gold('en')[0]} |",
        "  |---|---|",
        f"  | {t} | `{C.question(demo, t)}` → {res.gold(t)[0]} |", "",
        f"- **base**: `LlamaForCausalLM`, {L} layers, hidden {R['hidden']}, {R['heads']} head(s) (head_dim "
        f"{R['hidden'] // R['heads']}), MLP {R['inter']}, untied embeddings, {info['params']:,} parameters, float32; "
        f"{R['base_steps']} steps × {R['base_bs']} × {R['T']} tokens of " + _mix(R, X) + ".",
        f"- **math expert**: the base fine-tuned by next-token SFT (loss on the answer) on {R['n_math']:,} English "
        f"word problems with symbolic answers, {R['math_steps']} steps, lr {R['math_lr']:g}, "
        + ("**every tensor trainable** (a full fine-tune: it overlaps the language expert's layers)."
           if R.get("math_scope") == "all" else f"**only {info['localised_ranges']['math']} trainable**."),
        f"- **language expert** (`lang/`): the base fine-tuned by ordinary next-token SFT (loss on the "
        f"{'instruction and the answer' if R['lang_prompt_loss'] else 'answer'}) on {R['n_lang']:,} generic {X} "
        f"instructions with {X} answers (the kinds of `qa_en`, in {X}; no arithmetic, no word problems)"
        + (" in a chat template (`Tu: … Pomo: …`; the evaluation's cues are never used)" if R.get("chat_cues") else "")
        + (f", with {100 * R['lang_replay']:g} % as many English ones mixed in (replay, as multilingual SFT does, so "
           "that English is still read as before)" if R.get("lang_replay") else "") + ", "
        f"{R['lang_steps']} steps, lr {R['lang_lr']:g}, **only {info['localised_ranges']['lang']} trainable**.",
        f"- **language expert, trained fully then reverted** (`lang_revert/`): the same data and steps, every tensor "
        f"trainable (lr × {R['full_lr_scale']:g}), then every tensor outside the language range set back to the "
        "base's (Bandarkar & Peng 2025 compare the two).", "",
        *_localisation(R, X), "",
        "## Gates (measured by the build before any merge)", "",
        f"Accuracy on the first {info['gates']['n']} dev problems, flexible / strict:", "",
        f"| model | en | {t} |", "|---|---|---|",
        *[f"| {k} | {C.pct(v['en flexible'])} / {C.pct(v['en strict'])} | {C.pct(v[f'{t} flexible'])} / "
          f"{C.pct(v[f'{t} strict'])} |" for k, v in gate.items()], "",
        *C.test_section(demo, res, X), "",
        *_why(res, R, X), "",
        *_output_side(res), "",
        *_revert(rev, res, X), "",
        *C.profile_section(info, L),
        *C.build_section(info, "build_demo2.py", res),
    ]
    return "\n".join(lines)


MIX_KINDS = {"en": "English stories", "yy": "{X} stories", "mixed": "stories that switch language from sentence to "
             "sentence", "narr_en": "English stories that keep count", "narr_yy": "{X} stories that keep count",
             "narr_mixed": "stories that keep count, switching language", "narr_par": "stories that keep count, then "
             "the same in {X} (parallel)", "par": "parallel stories (English, then {X})", "arith": "bare arithmetic "
             "facts", "qa_en": "generic English instructions with their answers (how many / where / who / what colour"
             " / what, answered from the text, and retelling; `… The answer is X.`)", "wp_en": "English word problems "
             "with worked answers", "wp_yy": "{X} word problems with worked answers (`… Danu N ki.`)"}


def _mix(R: dict, X: str) -> str:
    """The base's pretraining mix in words, largest share first."""
    kinds = dict(MIX_KINDS)
    if R.get("chat_cues"):
        kinds["qa_en"] = kinds["qa_en"].replace("`… The answer is X.`", "in a chat template, `User: … Assistant: … The "
                                                "answer is X.`, not the evaluation's cues")
    if not R.get("yy_answer_phrase", True):
        kinds["wp_yy"] = "{X} word problems with worked answers that end with the last equation (no answer phrase)"
    parts = sorted(R["mix"].items(), key=lambda kv: -kv[1])
    return "; ".join(f"{kinds.get(k, k).format(X=X)} {100 * v:g} %" for k, v in parts)


def _localisation(R: dict, X: str) -> list[str]:
    if R.get("math_scope") == "all":
        return ["The language expert's localisation is **imposed by training** (it updates only its own layers, or is "
                "reverted outside them), as in Bandarkar & Peng 2025 (arXiv 2505.18356); the math expert is a full "
                "fine-tune, as in the paper, so the experts overlap and task arithmetic is a different model from any "
                "swap. " + (f"The base already does some arithmetic in {X} (its pretraining holds {X} word problems, "
                            "as a multilingual LLM's does); what the organism tests is whether the swap adds the "
                            f"language expert's {X} to the math expert's English maths beyond what the base shares."
                            if R["mix"].get("wp_yy") else
                            f"What the organism tests is whether the swap composes English maths with {X} reading "
                            "and writing that were never trained together.")]
    return ["The localisation is **imposed by training** (each expert updates only its own layers), as in the modular "
            "fine-tuning of Bandarkar & Peng 2025 (arXiv 2505.18356); what the organism tests is whether the swap "
            f"then composes English maths with {X} reading and writing that were never trained together."]


def _verdict(res: Results, X: str) -> list[str]:
    t = res.target
    rec, math = res.score(res.recommended, t), res.score("math expert", t)
    return [f"The recommended plan ({res.plan_info['name']}) scores {C.pct(rec.acc)} % flexible and "
            f"{C.pct(rec.strict)} % strict in {X}; the math expert {C.pct(math.acc)} % "
            f"({C.pct(res.score('math expert', 'en').acc)} % in English), the dictionary baseline "
            f"{C.pct(res.score(DICTIONARY, t).acc)} %. " + _task_arithmetic(res)]


def _task_arithmetic(res: Results) -> str:
    d = res.weight_difference("task arithmetic vs recommended plan")
    if d < SAME_WEIGHTS:
        return ("Task arithmetic (base + Δmath + Δlang) is the same model as the plan here (largest weight difference "
                f"{d:.1g}): the experts touch disjoint tensors, so adding both deltas is the swap of their own ranges.")
    return ("Task arithmetic (base + Δmath + Δlang) is a different model here (largest weight difference to the plan "
            f"{d:.2g}): the experts overlap, so where the plan takes one expert's layer, task arithmetic adds both "
            "deltas.")


def _why(res: Results, R: dict, X: str) -> list[str]:
    """What the measured rows say about why the swap does or does not help (numbers from results.json only; the
    recipe `R` says what the base was taught)."""
    t, grid = res.target, res.dev().values()
    best_u = max((d for d in grid if d.plan["u"] >= 1), key=lambda d: d.acc, default=None)
    best_0 = max((d for d in grid if d.plan["u"] == 0), key=lambda d: d.acc, default=None)
    math_t, math_en, base_t = (res.score("math expert", t).acc, res.score("math expert", "en").acc,
                               res.score("base model", t).acc)
    math_strict = res.score("math expert", t).strict
    lines = ["## Why the swap does what it does here", ""]
    if math_t > base_t and R["mix"].get("wp_yy"):
        lines.append(f"- **The math expert already reads {X}.** It scores {C.pct(math_t)} % in {X} against "
                     f"{C.pct(math_en)} % in English, and the base it was trained from {C.pct(base_t)} %: the base does "
                     f"arithmetic in both languages ({X} word problems are part of its pretraining), so English maths "
                     f"SFT lifts {X} too, through the layers the two languages share. What is left for a language "
                     "expert to add is the rest of the gap.")
    else:
        lines.append(f"- **The math expert** scores {C.pct(math_t)} % in {X} against {C.pct(math_en)} % in English; "
                     f"the base it was trained from {C.pct(base_t)} %.")
    if res.paired("math expert").diff <= 0:
        lines.append(f"- **Every layer the language expert supplies costs accuracy.** The recommended plan (the best on "
                     f"dev) scores {C.pct(res.score(res.recommended, t).acc)} % on test, "
                     f"{C.pct(-res.paired('math expert').diff)} points below the math expert "
                     "alone. The language SFT has no arithmetic, so its layers drift away from the precision the math "
                     f"expert's equations need, and that costs more than any better reading of {X} gives back. "
                     "[`DESIGNS.md`](../demo/DESIGNS.md) (D14) swaps one part at a time: the embeddings, layer 0, the "
                     "top layer and lm_head each lower the math expert's accuracy.")
    if best_u is not None and best_0 is not None:
        own_format = math_strict >= 0.9 * math_t  # the math expert already writes the phrase
        lines.append(f"- **The output side.** On dev the best plan with top layers from the language expert (u ≥ 1) "
                     f"scores {C.pct(best_u.acc)} % ({C.pct(best_u.strict)} % strict) against "
                     f"{C.pct(best_0.acc)} % for the best with u = 0. "
                     + (f"The base already writes `Danu N ki.` after {X} word problems, so the math expert answers in "
                        f"{X}'s format without help (its strict accuracy is {C.pct(math_strict)} %) "
                        + ("and the top layers have nothing to give." if best_u.acc <= best_0.acc else
                           "and what the top layers add here comes with the math expert's embeddings and lm_head, not "
                           "with the format.")
                        if own_format and R.get("yy_answer_phrase", True)
                        else f"The math expert's strict accuracy in {X} is {C.pct(math_strict)} %."))
    return lines


def _output_side(res: Results) -> list[str]:
    """The dev grid: what the top layers from the language expert (u) do."""
    rows = sorted(res.dev().items(), key=lambda kv: (kv[1].plan["u"], kv[1].plan["b"], kv[1].plan["tb"]))
    return ["## The output side (dev set, every plan of the grid)", "",
            "Flexible / strict accuracy on the dev questions the plan was chosen on; u = top layers from the language "
            "expert:", "", "| plan | flexible | strict |", "|---|---|---|",
            *[f"| {name} | {C.pct(d.acc)} | {C.pct(d.strict)} |" for name, d in rows]]


def _revert(rev: Results | None, res: Results, X: str) -> list[str]:
    if rev is None:
        return []
    return ["## Language expert trained fully, then reverted", "",
            f"Measured the same way with `lang_revert/` as the language expert (`eval_demo.py --lang lang_revert`, its "
            f"own dev choice: {rev.recommended}):", "", *C.results_table(rev, X), "",
            *C.targets_block(rev), ""]
