"""The parts both organism cards share (`demo_card.py`: the cipher organism; `demo2_card.py`: the paper's setting):
the results tables, paired comparisons, targets, test, profile and build sections. Every number is read through
`layerswap.shipped.results.Results` (the one reader of ``results.json``) or from ``build_info.json``; nothing here
imports another card script.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from layerswap.evaluation import mgsm  # noqa: E402
from layerswap.shipped.results import DICTIONARY, SKILL_FLOOR, Results  # noqa: E402

ORDER = ["base model", "math expert", "language expert", "soup 50/50", "TIES (density 0.2)", "task arithmetic",
         DICTIONARY, SKILL_FLOOR]


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def lang_name(demo: Path, code: str) -> str:
    return mgsm.languages(demo / "mgsm")[code].name


def results_table(res: Results, target_name: str) -> list[str]:
    t = res.target
    names = [n for n in ORDER if n in res.models()] + [n for n in res.models() if n not in ORDER]
    lines = [f"| model | {target_name} flexible [95 % CI] | {target_name} strict | English flexible [95 % CI] | "
             "English strict |", "|---|---|---|---|---|"]
    for n in names:
        cells = [f"{pct(s.acc)} [{pct(s.lo)}, {pct(s.hi)}] | {pct(s.strict)}" if res.has(n, lang) else "– | –"
                 for lang in (t, "en") for s in [res.score(n, lang) if res.has(n, lang) else None]]
        label = f"**{n}**" if n == res.recommended else n
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def paired_rows(res: Results) -> list[str]:
    return [f"| {n} | {100 * c.diff:+.1f} ± {100 * c.se:.1f} | {c.z} | {c.only_a} / {c.only_b} | {c.p:.3g} |"
            for n, c in res.comparisons().items()]


def paired_table(res: Results, target_name: str) -> list[str]:
    return [f"Paired per-question comparisons on {target_name}, recommended plan minus each row: difference in points "
            "± one SE, z, questions only the plan / only the other got right, exact McNemar p:", "",
            "| model | difference | z | only plan / only other | McNemar p |", "|---|---|---|---|---|",
            *paired_rows(res)]


def sample_outputs(res: Results, target_name: str, index: int = 0) -> list[str]:
    t = res.target
    lines = []
    for n in ["math expert", "language expert", res.recommended, DICTIONARY, "soup 50/50"]:
        for lang in (t, "en"):
            out = res.outputs(n, lang) if res.has(n, lang) else None
            if out is None:
                continue
            ok = "correct" if res.correct(n, lang)[index] == "1" else "wrong"
            lines.append(f"- {n}, {target_name if lang == t else 'English'}: `{out[index].strip()}` ({ok})")
    return lines


def same_count(res: Results, a: tuple[str, str], b: tuple[str, str]) -> int:
    """Questions on which model a[0] in language a[1] wrote exactly what b[0] wrote in b[1]."""
    return sum(p == q for p, q in zip(res.outputs(*a), res.outputs(*b), strict=True))


def answer_counts(res: Results, name: str, lang: str) -> dict[str, int]:
    """How often `name` wrote each of its two most common (stripped) answers."""
    return dict(Counter(o.strip() for o in res.outputs(name, lang)).most_common(2))


def targets_block(res: Results) -> list[str]:
    targets = res.targets()
    n_met = sum(targets.values())
    head = ("**The organism meets all of its targets.**" if res.targets_met else
            f"**The organism does not meet all of its targets** ({n_met} of {len(targets)}; see below).")
    return [head, "", "| target | met |", "|---|---|",
            *[f"| {k} | {'yes' if v else '**no**'} |" for k, v in targets.items()]]


def test_section(demo: Path, res: Results, X: str) -> list[str]:
    rec = res.plan_info
    return [
        "## Results on the test sets", "",
        f"n = {res.n} per language (the same problems in both), never used for training or "
        f"choice. Protocol: `mgsm_native_cot` 0-shot, greedy, at most {res.max_new_tokens} new tokens, "
        "flexible = last number of the answer; intervals are exact (Clopper-Pearson). Merges are layerswap's own "
        f"(`Workbench.build`). English is measured for {', '.join(res.english_measured_for)} (– elsewhere).", "",
        *results_table(res, X), "",
        f"The **recommended plan** ({rec['name']}: b={rec['b']}, u={rec['u']}, tb={rec['tb']}, tu={rec['tu']}, "
        f"{rec['transition']} {rec['transition_weight']}, non-layer {rec['non_layer']}) was chosen on the dev set "
        f"only ({rec['chosen_on']}, dev accuracy {pct(rec['dev_accuracy'])} %) and is in `recommended_plan.json`; "
        "the app preselects it. The base model is task arithmetic with λ = 0. The dictionary baseline and the "
        "arithmetic floor are computed by `eval_demo.py` (no training).", "",
        *paired_table(res, X), "",
        f"Floors on {X} (no skill needed): " + "; ".join(f"{k} {pct(v)} %" for k, v in res.floors().items()) + ".",
        "", "Answers to test item 0 (all outputs are in `results.json`):", "", *sample_outputs(res, X)]


def profile_section(info: dict, L: int) -> list[str]:
    return ["## Where the experts changed", "",
            "Relative change ‖Δ‖/‖θ_base‖ in percent, by layer (bottom to top), then embeddings, final norm, lm_head:",
            "", "| expert | " + " | ".join(f"L{i}" for i in range(L)) + " | emb | norm | head |",
            "|---|" + "---|" * (L + 3),
            *_profile_rows(info, "change_profile", ""), *_profile_rows(info, "change_profile_unlocalised",
                                                                      "unlocalised "),
            *_profile_rows(info, "change_profile_revert", "reverted "), ""]


def build_section(info: dict, script: str, res: Results | None = None) -> list[str]:
    """The build paragraph; with `res`, also how long the last `eval_demo.py` run took and, when its plan came from
    a `layerswap search` (its row name says ``search:``), the `--search` flag that reproduces the choice."""
    measure = "`python scripts/eval_demo.py --demo DIR` then measures it and rewrites this card."
    if res is not None:
        searched = "(search: " in res.recommended
        measure = ("`python scripts/eval_demo.py --demo DIR" + (" --search FILE`" if searched else "`") +
                   f" then measures it and rewrites this card ({res.seconds} s on {res.date}"
                   + (", `FILE` being the `--json-out` of `layerswap search` on the same three models, whose plan "
                      "joined the dev grid" if searched else "") + ").")
    return [
        "## Build", "",
        f"`python scripts/{script}` (seed {info['seed']}, {info['threads']} thread(s), deterministic): "
        f"{info['seconds']['total']} s on the build machine ({', '.join(f'{k} {v} s' for k, v in info['seconds'].items() if k != 'total')}). "
        + (f"That run loaded the base and experts of an earlier from-scratch build of the same recipe "
           f"(`--reuse-base`, `--reuse-experts`; {info['from_scratch']}) and wrote weights identical to it by "
           "sha256; it measured the gates and profiles. " if info.get("base_reused_from") and info.get("from_scratch")
           else "")
        + (f"Measured {info['measured_on']}. " if info.get("measured_on") else "") +
        "`python3 scripts/dev.py test -m slow` rebuilds it from scratch, checks every weight file by sha256 and "
        "re-measures it. " + measure + " Every "
        "design tried on the way, with its numbers, is in [`DESIGNS.md`](../demo/DESIGNS.md).", ""]


def question(demo: Path, lang: str) -> str:
    """The first test question of `lang`, as stored."""
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
