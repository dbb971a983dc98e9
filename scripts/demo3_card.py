#!/usr/bin/env python
"""Write the family organism's card, ``assets/demo3/README.md``, from its ``build_info.json``, ``mgsm/`` and
``family_table.json`` only.

The family's evaluation table (every language: math expert, language expert, swap, baselines) is not measured
here: ``layerswap eval`` over the family writes ``family_table.json`` (the command is in the card), and the card
renders it between ``<!-- family-table -->`` and ``<!-- /family-table -->``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from layerswap.evaluation import mgsm  # noqa: E402

TABLE_START, TABLE_END = "<!-- family-table -->", "<!-- /family-table -->"


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def shows(info: dict, codes: list[str]) -> str:
    """The measured story in one paragraph: each swap against the math expert in its language and in English."""
    dev = info["gates"]["dev_flexible_and_strict"]
    m = dev["math"]
    per = "; ".join(f"{c}: swap {pct(dev[f'swap {c}'][f'{c} flexible'])} % against the math expert's "
                    f"{pct(m[f'{c} flexible'])} %" for c in codes)
    swap_en = [dev[f"swap {c}"]["en flexible"] for c in codes]
    strict = max(dev[f"swap {c}"][f"{c} strict"] for c in codes)
    return (f"On the dev problems each swap does maths in its own cipher where the math expert alone does not ({per}), "
            f"but far below the math expert's {pct(m['en flexible'])} % in English: the swaps score "
            f"{pct(min(swap_en))}-{pct(max(swap_en))} % in English themselves, so the language experts' layers cost "
            f"the math expert's arithmetic most of its accuracy. The swaps write the answer phrase "
            + ("in English (strict accuracy in each cipher, which reads the cipher's own phrase, at most "
               f"{pct(strict)} %)." if strict < 0.05 else f"in the cipher (strict accuracy up to {pct(strict)} %)."))


def card(demo: Path) -> str:
    info = json.loads((demo / "build_info.json").read_text())
    R, g, codes = info["recipe"], info["gates"], list(info["languages"])
    langs = mgsm.languages(demo / "mgsm")
    dev, speak, verdicts = g["dev_flexible_and_strict"], g["speaks"], g["verdicts"]
    n_test = len(mgsm.load("en", demo / "mgsm"))
    met = sum(v["passed"] for v in verdicts.values())
    secs = info["seconds"]
    total = secs["total"] + secs.get("base_pretraining_in_reused_build", 0)
    lines = ["---", "license: mit", "language: [en]",
             "tags: [layer-swapping, model-merging, synthetic, toy-model, layerswap-demo, expert-family]", "---", "",
             "# layerswap demo family: one math expert, three cipher language experts", "",
             "Tiny Llama-architecture checkpoints (`base/`, `math/`, " + ", ".join(f"`lang_{c}/`" for c in codes)
             + ") and MGSM-format sets (`mgsm/`, one per language) for layerswap's family workflow, offline. Built "
             "from scratch by [`scripts/build_demo3.py`](../../scripts/build_demo3.py); this card is written by "
             "[`scripts/demo3_card.py`](../../scripts/demo3_card.py) from `build_info.json` and `mgsm/` only. "
             "Preset **demo3** (`assets/presets.yaml`) loads it.", "",
             "## What it is", "",
             f"The cipher organism (`assets/demo`, a positive control) extended to {len(codes)} target languages. Each "
             "language is a word-level cipher of English with a lexicon of its own, drawn from its own sound system "
             "(one word for every English word of the world, its cues and answer phrase included; the same word "
             "order; names, digits and punctuation shared), so what a model learns of one language's words says "
             "nothing of another's. All members come from **one base** and share its tokenizer and shape:", "",
             "| code | language | question cue | answer phrase | first test question |", "|---|---|---|---|---|",
             f"| en | English | `{langs['en'].question}` | `The answer is N.` | "
             f"`{mgsm.load('en', demo / 'mgsm')[0].question}` |"]
    for c in codes:
        phrase = langs[c].strict_regex.split(" (")[0].replace("\\", "")
        lines.append(f"| {c} | {langs[c].name} | `{langs[c].question}` | `{phrase} N.` | "
                     f"`{mgsm.load(c, demo / 'mgsm')[0].question}` |")
    lines += ["", f"- **base**: `LlamaForCausalLM`, {R['layers']} layers, hidden {R['hidden']}, {R['heads']} head "
              f"(head_dim {R['hidden'] // R['heads']}), MLP {R['inter']}, untied embeddings, {info['params']:,} "
              f"parameters, float32, a word-level tokenizer of {info['vocab']} words; {R['base_steps']} steps × "
              f"{R['base_bs']} × {R['T']} tokens of English stories, stories in each cipher, parallel text (a story, "
              "then the same in a cipher), bare arithmetic facts and generic English instructions in a chat template "
              f"(mix {R['mix']}); no word problems.",
              f"- **math expert** (`math/`): the base fine-tuned by next-token SFT on {R['n_math']:,} English word "
              f"problems with symbolic answers (MGSM's English cues), {R['math_steps']} steps, lr {R['math_lr']:g}, "
              f"only its own range trainable: {info['localised_ranges']['math']}.",
              f"- **language experts** (`lang_CODE/`, one per cipher): the base fine-tuned on that cipher only, "
              f"{R['lang_steps']} steps, lr {R['lang_lr']:g}, only its own range trainable "
              f"({info['localised_ranges']['lang']}): SFT on {R['n_lang']:,} generic instructions in the cipher's "
              "chat template (no arithmetic; never the evaluation's cues), next-token loss on cipher stories, and an "
              "alignment loss (its hidden states after the bottom layers on cipher prompts match the base's on the "
              "English twins).",
              f"- **test sets**: `mgsm/mgsm_CODE.tsv`, the same {n_test} held-out word problems in English and in each "
              f"cipher (parallel, as MGSM's are); `mgsm/dev/` {len(mgsm.load('en', demo / 'mgsm' / 'dev'))} others "
              "for choosing plans; `mgsm/exemplars.json`, `languages.json` (each cipher's cues and strict answer "
              "format); `dictionary.json`, each cipher's whole lexicon.", "",
              "## What it shows", "",
              "A positive control for the **family** workflow (one math expert, one language expert per language, one "
              "swap per language, all from one base), not evidence for the paper's claim: each target language "
              "differs from English only in its lexicon, as in `assets/demo`, so a swap that takes a language "
              "expert's embeddings and bottom layers translates the words and lets the English math expert do the "
              "rest" + ("; its top layers, final norm and lm_head come from the language expert too." if R["lang_top"]
                        else "; the math expert's top layers and lm_head write the answer, in English."), "",
              shows(info, codes), "",
              f"Gates, measured by the build on the first {g['n']} dev problems (flexible / strict accuracy in %; the "
              "swap is each pair's own ranges, the library's in-memory merge):", "",
              "| model | " + " | ".join(["en", *codes]) + " |", "|---|" + "---|" * (len(codes) + 1)]
    for name, row in dev.items():
        lines.append(f"| {name} | " + " | ".join(f"{pct(row[f'{c} flexible'])} / {pct(row[f'{c} strict'])}"
                                                for c in ["en", *codes]) + " |")
    lines += ["", f"Does each model speak each cipher? Share (%) of {g['n_speak']} held-out instructions, asked in the "
              "cipher's chat template, answered with that cipher's answer phrase and the right word:", "",
              "| model | " + " | ".join(codes) + " |", "|---|" + "---|" * len(codes)]
    for name, row in speak.items():
        lines.append(f"| {name} | " + " | ".join(pct(row[c]) for c in codes) + " |")
    lines += ["", f"Verdicts ({met} of {len(verdicts)} gates met; the thresholds are the recipe's: swap at least "
              f"{pct(R['swap_margin'])} points above the math expert in its language, a language expert speaking its "
              f"cipher on at least {pct(R['speak_floor'])} % and more than the base, the math expert at least 50 % in "
              "English plus half the base's):", ""]
    for k, v in verdicts.items():
        nums = ", ".join(f"{a} {pct(b)}" for a, b in v.items() if a != "passed")
        lines.append(f"- {k.replace('_', ' ')}: **{'yes' if v['passed'] else 'no'}** ({nums})")
    lines += ["", "## The family's evaluation table", "", *family_block(demo, codes, n_test), "",
              "## Build", "",
              f"`python scripts/build_demo3.py --seed {info['seed']} --threads {info['threads']}` (deterministic: the "
              f"same weights bit for bit), {total} s in all on {info['machine']['cpus']} shared cores (load "
              f"{info['machine']['load_average_at_end'][0]} at the end): "
              + ", ".join(f"{k} {v} s" for k, v in secs.items() if k != "total")
              + (f"; base reused from an earlier build of the same recipe ({info['base_reused_from']})"
                 if info.get("base_reused_from") else "") + ". sha256 of each model:", ""]
    lines += [f"- `{k}/model.safetensors`: `{v}`" for k, v in info["sha256"].items()]
    return "\n".join(lines) + "\n"


COMMAND = ("layerswap eval --math assets:demo3/math --base assets:demo3/base {langs} --methods swap,soup,ta,ties "
           "--b 2 --u 1 --tb 0 --tu 0 --engine transformers --json assets/demo3/family_table.json")


def cell(c: dict | None, expert: bool) -> str:
    """One cell of the table: accuracy [exact 95 % interval], and p against the better expert for a merge."""
    if c is None:
        return "–"
    lo, hi = c["interval"]
    p = "" if expert or c.get("p_vs_better_expert") is None else f", p = {c['p_vs_better_expert']:.2g}"
    return f"{pct(c['accuracy'])} [{pct(lo)}, {pct(hi)}]{p}"


def family_block(demo: Path, codes: list[str], n_test: int) -> list[str]:
    """The family's table, rendered from ``family_table.json`` (what `layerswap eval --json` wrote), or the place
    kept for it while it is not measured."""
    langs = " ".join(f"--lang {c}=assets:demo3/lang_{c}" for c in codes)
    cmd = ["```bash", COMMAND.format(langs=langs), "```"]
    f = demo / "family_table.json"
    if not f.is_file():
        return [TABLE_START, f"*Not measured yet* (n = {n_test} per language). Measure it with:", "", *cmd, TABLE_END]
    t = json.loads(f.read_text(encoding="utf-8"))
    res, langs_ = t["results"], t["languages"]
    n = sorted({res[c][m]["n"] for c in langs_ for m in res[c]})
    lines = [TABLE_START,
             f"MGSM-format held-out test questions of each cipher (n = {', '.join(map(str, n))} per language and "
             f"model, never used to build or to choose anything), {t['protocol']['mode']}, "
             f"{t['protocol']['shots']}-shot, greedy, {t['metric']} accuracy in % [exact 95 % interval]; p: exact "
             "McNemar test, paired on the same questions, against the better expert of that language. Measured by:",
             "", *cmd, "", "| model | " + " | ".join(langs_) + " | average |", "|---|" + "---|" * (len(langs_) + 1)]
    for m in t["models"]:
        expert = m in ("math expert", "language expert")
        lines.append(f"| {m} | " + " | ".join(cell(res[c].get(m), expert) for c in langs_)
                     + f" | {pct(t['average'][m])} |")
    best = {m: t["average"][m] for m in t["models"]}
    lines += ["", "What it shows, and what it does not:", "",
              f"- The swap (the language experts' own trained ranges, b=2 u=1, fixed by construction before any "
              f"measurement) answers {pct(best['swap'])} % on average against the math expert's "
              f"{pct(best['math expert'])} % and the language expert's {pct(best['language expert'])} %, in every "
              "language with its interval above every other model's but task arithmetic's (p above). Soup stays at "
              "the experts' level; TIES is mixed (above the math expert in one language, below it in another), "
              "far below the swap everywhere.",
              "- Task arithmetic (λ = 1) gives the swap's answers, question for question (the same 1,500 outputs): in "
              "this organism no "
              "tensor is changed by both experts (the math expert trains layers 2-6, each language expert the "
              "embeddings, layers 0-1 and 7, the final norm and lm_head), so base + Δmath + Δlang is the swap up to "
              "float rounding (largest difference 3e-8). A real pair of experts, whose changes overlap, is where "
              "the two differ; this organism cannot show which is better there.",
              "- The swap is far from the math expert's English level (see the gates above): the language experts' "
              "layers also change the arithmetic, and the swaps answer with the English answer phrase, so strict "
              "accuracy is 0 in every cipher. It shows that the family's transfer works per language with one "
              "shared plan; it does not show a high absolute accuracy, nor anything about real languages.",
              TABLE_END]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description="Write assets/demo3/README.md from its build_info.json.")
    ap.add_argument("--demo", default=str(REPO / "assets" / "demo3"))
    args = ap.parse_args()
    readme = Path(args.demo) / "README.md"
    text = card(Path(args.demo))
    readme.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
