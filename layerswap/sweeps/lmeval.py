"""Other metrics through lm-evaluation-harness: its own task definitions and its HF / vLLM backends, run on
a model folder or on the export of a recipe. `layerswap lm-eval` prints them and can append them to a
sweep's results file (`sweeps.records.lm_eval_record`), where `sweeps.report.results_table` joins them to
the same recipe's MGSM row.

    cfg = LmEvalConfig(tasks=["belebele_swh_Latn"], limit=100)
    metrics = evaluate_model("merged/", cfg)                # {task: {metric: value}}
    metrics = evaluate_recipe(math, lang, base, recipe, cfg)  # exports the merge to a temporary folder

Local tasks (a YAML task file on a data file, as lm-eval defines them) are found through
``include_path``. Needs ``pip install lm-eval``.

Which backend runs is the one engine decision (`engines.choice.choose_engines`, for the one model lm-eval loads)
in lm-eval's words (`backend_for`: transformers is its ``hf``, vLLM its ``vllm``).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from layerswap.core.errors import UserError
from layerswap.core.runtime import resolve_device
from layerswap.engines import choice
from layerswap.engines.vllm_engine import EngineStartError
from layerswap.models.checkpoints import Checkpoint
from layerswap.recipe.recipes import Recipe

LM_EVAL_BACKENDS = {"transformers": "hf", "vllm": "vllm"}  # the engine choice's words -> lm-eval's
BACKENDS = tuple(LM_EVAL_BACKENDS.values())


def backend_for(model: Checkpoint, settings: choice.EngineSettings) -> tuple[str, str]:
    """lm-eval's backend and device for `model` (a recipe's: its math expert, the export's shape): what the one
    engine decision says for it."""
    c = choice.choose_engines(settings, {"model": model})
    if c.engine == "none":
        raise EngineStartError(c.why)
    return LM_EVAL_BACKENDS[c.engine], resolve_device(c.device, ("cpu", "cuda"))


@dataclass
class LmEvalConfig:
    tasks: list[str] = field(default_factory=list)
    include_path: str | None = None  # folder of local task YAML files
    limit: int | None = None  # documents per task (None: all)
    num_fewshot: int | None = None  # None: the task's own default
    batch_size: int = 8
    backend: str = "hf"
    device: str = "cpu"
    dtype: str = "auto"

    def validate(self) -> None:
        if not self.tasks:
            raise UserError("Name at least one lm-eval task (--tasks belebele_swh_Latn,...).")
        if self.backend not in BACKENDS:
            raise UserError(f"lm-eval backend is hf or vllm, not {self.backend!r}.")
        if self.include_path and not Path(self.include_path).is_dir():
            raise UserError(f"--include-path {self.include_path}: no such folder of task files.")
        if self.limit is not None and self.limit < 1:
            raise UserError("limit must be at least 1 document per task.")

    def settings(self) -> dict:
        """What changes the numbers (part of a record's identity)."""
        d = asdict(self)
        d.pop("device")
        d.pop("batch_size")
        return d


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("lm-evaluation-harness is not installed: pip install lm-eval") from None
    return lm_eval, TaskManager


def evaluate_model(model: str | Path, cfg: LmEvalConfig) -> dict[str, dict[str, float]]:
    """Run lm-eval's tasks on one model folder (or Hub id); per task, its numeric metrics."""
    cfg.validate()
    lm_eval, TaskManager = _lm_eval()
    tm = TaskManager(include_path=cfg.include_path) if cfg.include_path else TaskManager()
    unknown = [t for t in cfg.tasks if t not in tm.all_tasks]
    if unknown:
        raise UserError(f"lm-eval does not know task{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
                        + ("" if cfg.include_path else " (local task files: --include-path DIR)") + ".")
    args = f"pretrained={model},dtype={cfg.dtype}"
    res = lm_eval.simple_evaluate(model=cfg.backend, model_args=args, tasks=cfg.tasks, task_manager=tm,
                                  limit=cfg.limit, num_fewshot=cfg.num_fewshot, batch_size=cfg.batch_size,
                                  device=cfg.device if cfg.backend == "hf" else None, log_samples=False)
    out: dict[str, dict[str, float]] = {}
    for task, r in res["results"].items():
        out[task] = {k.split(",")[0]: float(v) for k, v in r.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and "stderr" not in k}
        out[task].update({k.split(",")[0].replace("_stderr", " stderr"): float(v) for k, v in r.items()
                          if "stderr" in k and isinstance(v, (int, float))})
    return out


def evaluate_recipe(math: Checkpoint, lang: Checkpoint, base: Checkpoint | None, recipe: Recipe, cfg: LmEvalConfig,
                    *, force: bool = False, keep: str | Path | None = None,
                    ) -> dict[str, dict[str, float]]:
    """Export the recipe's merge (to `keep`, else a temporary folder) and run lm-eval on it; its metrics."""
    from layerswap.merge.merging import export_merge

    cfg.validate()
    tmp = None if keep else Path(tempfile.mkdtemp(prefix="layerswap-lmeval-"))
    out = Path(keep) if keep else tmp / "merged"
    try:
        export_merge(math, lang, recipe, out, base=base, force=force, overwrite=bool(keep))
        metrics = evaluate_model(out, cfg)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return metrics
