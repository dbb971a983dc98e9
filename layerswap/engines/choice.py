"""Which engine runs, decided in one place for every caller (`choose_engines`), and the settings it is asked with
(`EngineSettings`, whose command-line flags are declared once, in `ENGINE_FLAGS`, for the CLI and the app alike).

``engine`` is ``auto`` (vLLM when it is installed, serves the models here and fits, else transformers, saying why),
``vllm`` (fail with the reason instead of falling back) or ``transformers`` (never try vLLM); None reads
``$LAYERSWAP_ENGINE``. `EngineSettings` is what the CLI's engine options, the app's start-up flags and a sweep
file's ``engine:`` mapping become.

`choose_engines(settings, models)` answers, for
- a trio (``math`` and ``lang``): the engine plan (`planning.plan_engines`: the arrangement, its sizes and costs,
  where the analysis and the lens run beside the engines). Asked by `Workbench.check`, hence by the page, ``ask``,
  ``eval --math/--lang``, ``search`` and sweeps (each makes its workbench with `Workbench.from_settings`);
- one model (``model``): vLLM or transformers, and on which device. Asked by `open_engine` (``eval --model``),
  lm-eval (`sweeps.lmeval.backend_for`: its ``hf`` / ``vllm`` backend) and the lens outside a workbench
  (`analysis.lens.run_lens`, which runs transformers models; inside one it runs where the plan says).

`choose_family(settings, math, langs)` answers the same for a family (`family.plan_family`): asked once by a family
evaluation (`serving.family.evaluate_family`) before anything starts.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, fields, replace

from layerswap.core.errors import UserError
from layerswap.core.hardware import Hardware, current
from layerswap.core.runtime import resolve_device
from layerswap.engines.base import Engine
from layerswap.engines.family import FamilyPlan, plan_family
from layerswap.engines.planning import SERVING_CHOICES, EnginePlan, Releasing, plan_engines, vllm_availability
from layerswap.engines.transformers_engine import TransformersEngine
from layerswap.engines.vllm_engine import EngineStartError, VLLMEngine, VLLMSettings
from layerswap.models.checkpoints import Checkpoint

ENGINE_CHOICES = ("auto", "vllm", "transformers")


def resolve_engine_choice(engine: str | None) -> str:
    """``auto`` / ``vllm`` / ``transformers``; None means ``$LAYERSWAP_ENGINE`` or auto."""
    choice = (engine or os.environ.get("LAYERSWAP_ENGINE") or "auto").lower()
    if choice not in ENGINE_CHOICES:
        raise UserError(f"Unknown engine {choice!r}; use one of: {', '.join(ENGINE_CHOICES)}.")
    return choice


@dataclass(frozen=True)
class Flag:
    """One engine setting as a command-line flag: its `EngineSettings` field, flag, environment variable, help."""

    field: str
    flag: str
    env: str | None
    help: str  # "{default}" is filled in
    kind: type | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


ENGINE_FLAGS = (
    Flag("engine", "--engine", "LAYERSWAP_ENGINE", "auto: vLLM when installed and the models fit, else transformers "
         "(saying why); vllm: fail instead of falling back; transformers: never try vLLM (default {default})",
         choices=ENGINE_CHOICES),
    Flag("serving", "--serving", "LAYERSWAP_SERVING", "with two experts on vLLM: three engines, two (the language "
         "expert and the merge swapped on one), or one engine with weights swapped per model (auto: the first that "
         "fits; default {default})", choices=SERVING_CHOICES),
    Flag("max_model_len", "--max-model-len", "LAYERSWAP_MAX_MODEL_LEN", "vLLM context length (default: the "
         "model's, at most 4096)", kind=int, metavar="N"),
    Flag("tensor_parallel_size", "--tensor-parallel-size", "LAYERSWAP_TENSOR_PARALLEL_SIZE", "vLLM on GPUs: split "
         "each engine over N GPUs, for experts that do not fit on one (default {default})", kind=int, metavar="N"),
    Flag("device", "--device", "LAYERSWAP_DEVICE", "transformers engine and merges: cpu, cuda or auto (cuda when "
         "torch sees a GPU; default {default})"),
    Flag("chat_template", "--chat-template", None, "wrap prompts in the tokenizer's chat template (default: plain "
         "prompts, as lm-eval)"),
)


@dataclass(frozen=True)
class EngineSettings:
    """How a workbench answers: engine choice, device, vLLM serving mode and sizes, batch size, chat template."""

    engine: str | None = None  # auto, vllm, transformers; None: $LAYERSWAP_ENGINE
    device: str = "auto"  # transformers engine and merges
    serving: str = "auto"  # vLLM: three engines, or one with weights swapped (auto: by memory)
    batch_size: int = 8
    chat_template: bool | None = None  # True: the chat template (bounded); None or False: plain prompts
    max_model_len: int | None = None  # vLLM context length (None: the model's, at most 4096)
    tensor_parallel_size: int = 1  # vLLM on GPUs: GPUs per engine

    def vllm(self) -> VLLMSettings:
        return VLLMSettings(max_model_len=self.max_model_len, tensor_parallel_size=self.tensor_parallel_size)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineSettings":
        """From a sweep file's ``engine:`` mapping (absent keys take the defaults; plain prompts, as lm-eval)."""
        return cls(engine=d.get("engine"), device=d.get("device") or "auto", serving=d.get("serving") or "auto",
                   batch_size=int(d.get("batch_size") or 8), chat_template=bool(d.get("chat_template", False)),
                   max_model_len=d.get("max_model_len"), tensor_parallel_size=int(d.get("tensor_parallel_size") or 1))

    @classmethod
    def add_arguments(cls, p, only: tuple[str, ...] | None = None, defaults: dict | None = None,
                      env: bool = True) -> None:
        """The engine flags (`ENGINE_FLAGS`, or those named in `only`) on parser or group `p`; each defaults to its
        environment variable (unless `env` is False: what-if plans), else to `defaults` (a command's own), else to
        the field's default."""
        own = {f.name: f.default for f in fields(cls) if f.default is not MISSING} | (defaults or {})
        for f in ENGINE_FLAGS:
            if only is not None and f.field not in only:
                continue
            if f.env is None:  # a switch
                p.add_argument(f.flag, dest=f.field, action="store_true", help=f.help)
                continue
            default = (env and os.environ.get(f.env)) or own[f.field]  # a string is converted (checked) by `kind`
            shown = "auto" if f.field == "engine" and default is None else default
            p.add_argument(f.flag, dest=f.field, default=default, type=f.kind, choices=f.choices, metavar=f.metavar,
                           help=f.help.format(default=shown) + (f" (${f.env})" if env else ""))

    @classmethod
    def from_args(cls, ns: argparse.Namespace, chat_template: bool | None = False) -> "EngineSettings":
        """The settings the parsed engine flags say (flags a parser did not declare keep their defaults);
        `chat_template`: the command's default when --chat-template is not given (a model's template is rendered
        only when asked for, `engines.base.chat_template_choice`)."""
        given = {f.field: getattr(ns, f.field) for f in ENGINE_FLAGS if hasattr(ns, f.field)}
        given["chat_template"] = True if given.get("chat_template") else chat_template
        return cls(**given)


@dataclass(frozen=True)
class EngineChoice:
    """The one decision's answer: which engine runs, where, and where the analysis and the lens run beside it."""

    engine: str  # vllm, transformers, or none (nothing runs: `why` says why)
    device: str  # where the engines run
    analysis_device: str  # where the analysis and the lens run
    why: str  # why this engine ("chosen": the settings said so)
    plan: EnginePlan | None = None  # a trio's whole plan (arrangement, sizes, costs); None for one model


def choose_engines(settings: EngineSettings, models: dict[str, Checkpoint], *, vllm: VLLMSettings | None = None,
                   hardware: Hardware | None = None, releasing: Releasing = Releasing(),
                   alternatives: bool = True) -> EngineChoice:
    """The engines for `models` (``math`` and ``lang``: a trio, planned whole; or ``model``: one) under `settings`
    (`vllm`: vLLM settings beyond the flags'); see the module's docstring. Starts nothing."""
    choice = resolve_engine_choice(settings.engine)
    vllm = vllm or settings.vllm()
    device = None if settings.device in (None, "auto") else settings.device
    if "model" not in models:
        plan = plan_engines(models, engine=choice, serving=settings.serving, settings=vllm, device=device,
                            hardware=hardware, releasing=releasing, alternatives=alternatives)
        return EngineChoice(plan.engine, plan.device, plan.analysis_device, plan.why or plan.problem, plan)
    why = "chosen"
    if choice != "transformers":
        hw = hardware or current()
        if hardware is None and hw.played:  # played hardware plans trios; one model starts here, on this vLLM
            hw = replace(hw, vllm=None)
        ok, why, vdev = vllm_availability(models, hw)
        if ok:
            return EngineChoice("vllm", vdev, vdev, why)
        if choice == "vllm":
            return EngineChoice("none", vdev, vdev, why)
    dev = resolve_device(settings.device)
    return EngineChoice("transformers", dev, dev, why)


def choose_family(settings: EngineSettings, math: Checkpoint, langs: dict[str, Checkpoint], *,
                  hardware: Hardware | None = None, releasing: Releasing = Releasing()) -> FamilyPlan:
    """The engine plan of a family (`family.plan_family`: the math expert, the language experts of `langs`, their
    merges), asked with `settings` as `choose_engines` asks a trio's. Starts nothing."""
    device = None if settings.device in (None, "auto") else settings.device
    return plan_family(math, langs, engine=resolve_engine_choice(settings.engine), serving=settings.serving,
                       settings=settings.vllm(), device=device, hardware=hardware, releasing=releasing)


def open_engine(path: str | os.PathLike, *, engine: str | None = "auto", device: str = "auto",
                settings: VLLMSettings | None = None, use_chat_template: bool | None = None,
                batch_size: int = 8) -> tuple[Engine, str]:
    """An engine for one model (a folder, an ``assets:`` reference or a Hub id), as `choose_engines` says, and a
    note saying which engine answers and why; with engine ``auto`` a vLLM that does not start falls back to
    transformers."""
    ck = Checkpoint.open(path)  # the folder it names, checked as a model (a one-line refusal if not)
    c = choose_engines(EngineSettings(engine=engine, device=device), {"model": ck})
    if c.engine == "none":
        raise EngineStartError(c.why)
    why = c.why
    if c.engine == "vllm":
        try:
            eng = VLLMEngine.acquire(ck.path, settings, use_chat_template=use_chat_template)
            return eng, f"answered by vLLM ({why})"
        except EngineStartError as e:
            if resolve_engine_choice(engine) == "vllm":
                raise
            why = str(e)
    note = "answered by transformers (chosen)" if why == "chosen" else f"answered by transformers: {why}"
    return TransformersEngine.from_pretrained(ck.path, c.device if c.engine == "transformers" else device,
                                              batch_size=batch_size, use_chat_template=use_chat_template), note
