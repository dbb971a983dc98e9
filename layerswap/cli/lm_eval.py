"""`layerswap lm-eval`: lm-evaluation-harness tasks on a model, or on the merge of a recipe file."""

from __future__ import annotations

from pathlib import Path

from layerswap.core.errors import UserError
from layerswap.engines.choice import EngineSettings
from layerswap.recipe.recipes import Recipe
from layerswap.cli.options import models, open_checkpoint, open_trio, print_recipe

BACKEND_ENGINES = {"hf": "transformers", "vllm": "vllm"}  # --backend, lm-eval's words for --engine


def add_parser(sub) -> None:
    s = sub.add_parser("lm-eval", help="lm-evaluation-harness tasks (BELEBELE, FLORES, MMLU, MBPP, local task files) "
                                        "on a model, or on the merge of a recipe file")
    s.add_argument("target", metavar="MODEL_OR_RECIPE", help="a model folder / Hub id, or a recipe file (with --math --lang)")
    s.add_argument("--tasks", required=True, help="comma list of lm-eval task names")
    s.add_argument("--include-path", metavar="DIR", help="folder of local lm-eval task YAML files")
    s.add_argument("--limit", type=int, help="documents per task (default: all)")
    s.add_argument("--num-fewshot", type=int, help="few-shot examples (default: the task's)")
    s.add_argument("--batch-size", type=int, default=8)
    # the engine flags of every command; lm-eval's hf backend (transformers) unless --engine or $LAYERSWAP_ENGINE
    EngineSettings.add_arguments(s, only=("engine", "device"), defaults={"engine": "transformers"})
    s.add_argument("--backend", choices=tuple(BACKEND_ENGINES), help="lm-eval's name for --engine: hf (transformers) "
                   "or vllm")
    models(s, optional="with a recipe file: ")
    s.add_argument("--force", action="store_true", help="recipe: merge experts that seem not to share the base")
    s.add_argument("--keep", metavar="DIR", help="recipe: keep the exported merge in DIR (default: a temporary folder)")
    s.add_argument("--name", help="the row's name in a sweep table (default: the file or folder name)")
    s.add_argument("--sweep-results", metavar="FILE", help="append the metrics to this sweep results file")
    s.add_argument("-o", "--out", help="metrics as JSON")
    s.set_defaults(fn=run)


def run(args) -> int:
    from dataclasses import replace

    from layerswap.sweeps.lmeval import LmEvalConfig, backend_for, evaluate_model, evaluate_recipe
    from layerswap.models.presets import portable_ref
    from layerswap.sweeps.records import experts_identity, experts_shown, lm_eval_record
    from layerswap.sweeps.spec import set_name

    cfg = LmEvalConfig(tasks=[t.strip() for t in args.tasks.split(",") if t.strip()], include_path=args.include_path,
                       limit=args.limit, num_fewshot=args.num_fewshot, batch_size=args.batch_size)
    cfg.validate()
    settings = EngineSettings.from_args(args)
    if args.backend:
        settings = replace(settings, engine=BACKEND_ENGINES[args.backend])
    target = Path(args.target)
    if target.suffix.lower() in (".yaml", ".yml", ".json") and target.is_file():
        if not (args.math and args.lang):
            raise UserError(f"{args.target} is a recipe: give --math and --lang (and --base) to merge it first.")
        math, lang, base = open_trio(args)
        cfg.backend, cfg.device = backend_for(math, settings)
        recipe = Recipe.load(target)
        recipe.validate(math.num_layers)
        print_recipe(recipe, math.num_layers)
        metrics = evaluate_recipe(math, lang, base, recipe, cfg, force=args.force, keep=args.keep)
        cks = {"math": math, "lang": lang, **({"base": base} if base is not None else {})}
        rec = lm_eval_record(experts_shown(cks, experts_identity(cks)), recipe.to_dict(), args.name or target.stem,
                             cfg.settings(), metrics, args.force, set_name(args.math, args.lang))
    else:
        if args.math or args.lang:
            raise UserError(f"{args.target} is a model; --math/--lang are for a recipe file.")
        cks = {"model": open_checkpoint(args.target)}
        cfg.backend, cfg.device = backend_for(cks["model"], settings)
        metrics = evaluate_model(args.target, cfg)
        rec = lm_eval_record(experts_shown(cks, experts_identity(cks)), None, args.name or target.name,
                             cfg.settings(), metrics, set_name=portable_ref(args.target))
    for task, ms in metrics.items():
        print(f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in ms.items()))
    if args.out:
        import json

        Path(args.out).write_text(json.dumps(metrics, indent=2))
        print(f"wrote {args.out}")
    if args.sweep_results:
        from layerswap.sweeps.log import ResultsLog

        with ResultsLog(args.sweep_results) as log:
            log.append(rec)
        print(f"appended to {args.sweep_results} (joined to the same recipe's row in its table)")
    return 0
