"""The `layerswap` command line: inspect, merge, push, export-yaml, diff, ask, eval, sweep, lm-eval, app.

Every user error ends with a one-line reason on stderr and exit status 2 (1 for an
incompatible `inspect`), never a traceback. `options` holds the shared option groups,
`commands` what each command does.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import UserError
from ..ui.launch import add_arguments as add_app_arguments
from . import commands as c
from . import options as o


def build_parser() -> argparse.ArgumentParser:
    from ..version import __version__

    p = o.Parser(prog="layerswap", description="Layer swapping: merge a math expert and a language expert.")
    p.add_argument("--version", action="version", version=f"layerswap {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=o.Parser)

    s = sub.add_parser("inspect", help="compatibility report (headers, plus a few MB of sampled weights)")
    o.models(s)
    o.pairing_options(s, force=False)
    s.set_defaults(fn=c.cmd_inspect)

    s = sub.add_parser("merge", help="build the layer-swapped (or baseline) model and write it as an HF folder")
    o.models(s)
    o.recipe_options(s)
    o.pairing_options(s)
    s.add_argument("--device", default="auto", help=f"where computed tensors are merged: {o.DEVICE_HELP}")
    s.add_argument("-o", "--out", required=True, help="output folder (must not exist, unless --overwrite)")
    s.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    s.add_argument("--out-shard-size", default="5GB", help="maximum bytes per safetensors shard (default 5GB)")
    s.add_argument("--languages", metavar="CODES",
                   help="comma list of ISO 639 codes the merge is for (e.g. sw,en), for the model card's front matter")
    s.add_argument("--push-to", metavar="REPO_ID", help="then push the folder to your own Hub repo (see `layerswap push`)")
    s.add_argument("--private", action="store_true", help="with --push-to: create the repo private")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(fn=c.cmd_merge)

    s = sub.add_parser("push", help="upload an exported merge to your own Hugging Face Hub repo (only what changed)")
    s.add_argument("folder", metavar="OUT_DIR", help="a folder `layerswap merge` wrote")
    s.add_argument("repo_id", metavar="REPO_ID", help="owner/name; created if it does not exist")
    s.add_argument("--private", action="store_true", help="create the repo private")
    s.add_argument("--revision", metavar="BRANCH", help="push to this branch (created from the default one)")
    s.add_argument("--overwrite", action="store_true", help="push into a repo that is not a layerswap export")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(fn=c.cmd_push)

    s = sub.add_parser("export-yaml", help="the plan as a mergekit config (linear method) that reproduces the merge")
    o.models(s)
    o.recipe_options(s)
    s.add_argument("-o", "--out", default="-", help="YAML file (default: stdout)")
    s.set_defaults(fn=c.cmd_export_yaml)

    s = sub.add_parser("diff", help="where each expert changed: heatmaps, profile, top tensors, suggested plan")
    o.models(s, base_required=True)
    o.plan_options(s)
    s.add_argument("--no-plan", action="store_true", help="no plan overlay and no merged-model panels")
    s.add_argument("-o", "--out", action="append", default=[],
                   help="heatmap figure: .html or .png (repeat for both)")
    s.add_argument("--profile", action="append", default=[], help="per-layer profile figure: .html or .png")
    s.add_argument("--panels", default="math,lang,overlap,merged",
                   help="comma-separated: math, lang, overlap, merged, merged-math, merged-lang, math-lang "
                        "(default math,lang,overlap,merged)")
    s.add_argument("--metric", choices=["relative", "mean_abs", "topk"], default="relative",
                   help="relative change, mean |Δ|, or share of the top-k%% most-changed entries (default relative)")
    s.add_argument("--overlap-metric", choices=["cosine", "jaccard"], default="cosine",
                   help="overlap panel: cosine of the task vectors or Jaccard of the top-k%% sets (default cosine)")
    s.add_argument("--k", type=float, action="append",
                   help="top-k%% to compute exactly (repeat for several; the first is shown; default 1)")
    s.add_argument("--norm", choices=["raw", "row", "log"], default="raw",
                   help="colour normalisation: raw, per row (parameter type), or log10 (default raw)")
    s.add_argument("--csv", help="every metric of every tensor as CSV")
    s.add_argument("--top", type=int, default=10, help="print the N most-changed tensors (default 10; 0: none)")
    s.add_argument("--top-csv", help="all tensors ranked by --metric, both experts, as CSV")
    s.add_argument("--device", default="auto", help=f"where the arithmetic runs: {o.DEVICE_HELP}")
    s.add_argument("--workers", type=int, default=1,
                   help="threads streaming their own share of the tensors (CPU: one per free core, with "
                        "OMP_NUM_THREADS=1; default 1)")
    s.add_argument("--cache-dir", help="analysis cache folder (default $LAYERSWAP_CACHE/analysis)")
    s.add_argument("--no-cache", action="store_true", help="neither read nor write the analysis cache")
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(fn=c.cmd_diff)

    s = sub.add_parser("ask", help="the same question to math expert, language expert and merged model")
    o.models(s)
    o.recipe_options(s)
    o.pairing_options(s)
    s.add_argument("--question", help="free-text question (prompted in --mgsm-lang's MGSM format)")
    s.add_argument("--mgsm-lang", default="en", help="MGSM language code (default en)")
    s.add_argument("--index", type=int, help="MGSM question number (0-based) in --mgsm-lang")
    s.add_argument("--mgsm-dir", help="folder of mgsm_XX.tsv files (default: $LAYERSWAP_MGSM_DIR, else the Hub)")
    s.add_argument("--shots", type=int, default=0, choices=[0, 1, 2, 3, 4, 5, 6, 7, 8],
                   help="few-shot exemplars from exemplars.json (default 0, as lm-eval)")
    s.add_argument("--max-new-tokens", type=int, default=256)
    o.engine_options(s)
    s.set_defaults(fn=c.cmd_ask)

    s = sub.add_parser("eval", help="MGSM accuracy of a model (or of both experts and their merge), per language")
    s.add_argument("--model", metavar="M", help="model folder or Hub id to evaluate")
    s.add_argument("--math", metavar="M", help="math expert (with --lang: evaluate experts and merge)")
    s.add_argument("--lang", metavar="L", help="language expert")
    s.add_argument("--base", metavar="B", help="base model (task-vector methods, adapters, the shared-base check)")
    s.add_argument("--models", default="math,lang,merged", help="with --math/--lang: which of math,lang,merged")
    o.recipe_options(s)
    o.pairing_options(s)
    o.eval_options(s)
    o.engine_options(s)
    s.add_argument("-o", "--out", help="per-question results as JSONL")
    s.add_argument("--card", metavar="OUT_DIR",
                   help="write the results into this export's model card (README.md, layerswap.json): with --model "
                        "OUT_DIR itself; with --math/--lang, the export of the same experts and recipe")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=c.cmd_eval)

    s = sub.add_parser("sweep", help="merge and evaluate every recipe of a sweep file (resumable), or a grid / the "
                                      "ablation suite from flags; tables and plots")
    s.add_argument("file", nargs="?", metavar="SWEEP.yaml",
                   help="a sweep file (layerswap.sweeps.spec): experts, recipes or grid, test sets, settings")
    s.add_argument("--math", metavar="M", help="flag form: math expert")
    s.add_argument("--lang", metavar="L", help="flag form: language expert")
    s.add_argument("--base", metavar="B", help="flag form: base model")
    s.add_argument("--suite", choices=("grid", "ablations"), default="grid",
                   help="grid: (b, u, t) swap plans; ablations: transition, location, module and baseline variants")
    s.add_argument("--b-values", default="0-3", help="grid: bottom layer counts (default 0-3)")
    s.add_argument("--u-values", default="0-2", help="grid: top layer counts (default 0-2)")
    s.add_argument("--t-values", default="0,1", help="grid: transition widths tb = tu (default 0,1)")
    o.plan_options(s)
    o.pairing_options(s)
    o.eval_options(s)
    s.add_argument("--no-experts", action="store_true", help="skip evaluating the experts themselves")
    o.engine_options(s)
    s.add_argument("-o", "--out", help="results file (JSONL: one line per finished point; a rerun resumes it). "
                                      "A .csv name writes the table instead and keeps no results file")
    s.add_argument("--ray", type=int, metavar="N", help="run points in parallel on N Ray actors (pip install ray); "
                                                       "needs -o RESULTS.jsonl")
    s.add_argument("--ray-gpus", type=float, default=None, metavar="G",
                   help="GPUs per Ray actor (default: the engine's tensor-parallel size when above 1, else 0)")
    s.add_argument("--csv", action="append", help="the results table as CSV")
    s.add_argument("--html", help="a self-contained HTML page: table, statistics and figures")
    s.add_argument("--plot", action="append", help="figures (.html or .png): heatmap over (b, u), curves, bars; "
                                                   "one file per figure, suffixed -heatmap/-curves/-bars when several")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=c.cmd_sweep)

    s = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks (BELEBELE, FLORES, MMLU, MBPP, local task files) "
                                        "on a model, or on the merge of a recipe file")
    s.add_argument("target", metavar="MODEL_OR_RECIPE", help="a model folder / Hub id, or a recipe file (with --math --lang)")
    s.add_argument("--tasks", required=True, help="comma list of lm-eval task names")
    s.add_argument("--include-path", metavar="DIR", help="folder of local lm-eval task YAML files")
    s.add_argument("--limit", type=int, help="documents per task (default: all)")
    s.add_argument("--num-fewshot", type=int, help="few-shot examples (default: the task's)")
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="lm-eval's model backend (default hf)")
    s.add_argument("--device", default="auto", help=o.DEVICE_HELP)
    s.add_argument("--math", metavar="M", help="recipe: math expert")
    s.add_argument("--lang", metavar="L", help="recipe: language expert")
    s.add_argument("--base", metavar="B", help="recipe: base model")
    s.add_argument("--force", action="store_true", help="recipe: merge experts that seem not to share the base")
    s.add_argument("--keep", metavar="DIR", help="recipe: keep the exported merge in DIR (default: a temporary folder)")
    s.add_argument("--name", help="the row's name in a sweep table (default: the file or folder name)")
    s.add_argument("--sweep-results", metavar="FILE", help="append the metrics to this sweep results file")
    s.add_argument("-o", "--out", help="metrics as JSON")
    s.set_defaults(fn=c.cmd_lm_eval)

    s = sub.add_parser("app", help="the Gradio app (the same program as `python app.py`)")
    add_app_arguments(s)
    s.set_defaults(fn=c.cmd_app)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UserError as e:
        print(f"layerswap {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
