"""A family's language switch in running engines: the next language expert in, the math expert's engine untouched.

    switch_lang(workbench.answering_engines, lang_ck, progress, keep=False)    # `Workbench.switch_lang`

Per arrangement (`serving.answering.ARRANGEMENTS`), what the family plan's ``resident``, ``reload`` and ``adapters``
outcomes (`engines.family.FamilyPlan.runs`) mean in the engines that exist:

- ``transformers``: the expert read into a new model; with `keep` (``resident``) the previous one stays in memory
  and a language met again is not read again; without it its memory is freed first;
- ``three_vllm``: the language expert's engine loads the new weights in place (vLLM's live reload,
  `VLLMEngine.refresh`); two or one engine(s) with weights swapped: the new expert is swapped in before it answers;
  sleep-mode turns: its engine woken and reloaded;
- ``lora_vllm``: another adapter on the same engine (nothing reloaded), refused before anything changes when vLLM's
  LoRA cannot serve it or its merge needs a higher rank than the engine started with (`switch_problem`; a family's
  evaluation starts it for the family's highest, `engines.family.planned_on`).

The merge is dropped in every case (it was the previous language's); `Answering.load_merged` builds the next.
Refused while the transformers-first hand-over has the plan's engines still starting.
"""

from __future__ import annotations

from pathlib import Path

from layerswap.core.errors import UserError
from layerswap.core.hardware import HELD
from layerswap.core.roles import ROLE_NAMES
from layerswap.core.runtime import Progress, no_progress
from layerswap.engines.sizing import check_memory, vllm_lora_rank
from layerswap.engines.transformers_engine import TransformersEngine, load_model
from layerswap.engines.vllm_engine import LoRAEngine, SwappedEngine, TurnEngine
from layerswap.models.adapters import prefix_of
from layerswap.models.checkpoints import Checkpoint
from layerswap.serving.answering import Answering, Arrangement, LoRAVLLM, TransformersPair, VLLMArrangement


def switch_lang(ans: Answering, ck: Checkpoint, progress: Progress = no_progress, keep: bool = False) -> None:
    """`ck` (a language expert of the math expert's shape) into the engines answering now in place of the current
    one, the math expert's left as they are; `keep`: the previous expert stays in memory (``resident``)."""
    if not ans.answering or ans.pending is not None:
        raise UserError("Load the two experts first (and let the plan's engines start).")
    problem = switch_problem(ans.current, ck)
    if problem:
        raise UserError(problem)
    _switch(ans.current, ck, progress, keep)
    ans.recipe = None


def can_refuse(arr: Arrangement) -> bool:
    """Whether `arr` can refuse a language expert of the math expert's shape (`switch_problem`): only the one engine
    with vLLM's LoRA, whose rank was fixed when it started."""
    return isinstance(arr, LoRAVLLM)


def switch_problem(arr: Arrangement, ck: Checkpoint) -> str:
    """Why `ck` cannot be switched into `arr`'s engines ('' when it can): on the one engine with vLLM's LoRA, the
    new expert must be an adapter it serves, its merge within the LoRA rank the engine started with."""
    if not can_refuse(arr):
        return ""
    rank, why = vllm_lora_rank({"math": arr.trio.checkpoints["math"], "lang": ck})
    have = arr.vllm[0].settings.max_lora_rank or 0
    what = f"The {ROLE_NAMES['lang']} {Path(ck.adapter or ck.path).name}"
    if rank is None:
        return (f"{what} cannot join the running vLLM engine's LoRA adapters ({why}): load the experts again with it "
                "(they are then served dense).")
    if rank > have:
        return (f"{what} needs LoRA rank {rank} for its merge; the running vLLM engine serves up to {have}: load the "
                "experts again with it (a family's evaluation starts the engine for its highest rank).")
    return ""


def _switch(arr: Arrangement, ck: Checkpoint, progress: Progress, keep: bool) -> None:
    old, arr.trio.checkpoints["lang"] = arr.trio.checkpoints["lang"], ck
    arr.engines.pop("merged", None)
    if isinstance(arr, TransformersPair):
        _transformers(arr, old, ck, progress, keep)
    elif isinstance(arr, LoRAVLLM):
        arr.engines["lang"] = LoRAEngine(arr.vllm[0], ck.adapter)
    elif isinstance(arr, VLLMArrangement):
        _vllm(arr, ck, progress)
    else:
        raise TypeError(f"{type(arr).__name__} cannot switch its language expert")


def _transformers(arr: TransformersPair, old: Checkpoint, ck: Checkpoint, progress: Progress, keep: bool) -> None:
    kept: dict[str, TransformersEngine] = arr.__dict__.setdefault("kept", {})  # resident experts, by folder
    if keep:
        kept[str(old.path)] = arr.engines["lang"]
    eng = kept.pop(str(ck.path), None)
    if eng is None:
        arr.engines.pop("lang", None)  # its memory back first when it is not kept
        check_memory(ck.nbytes, arr.trio.device, f"the {ROLE_NAMES['lang']}")
        progress(0.1, f"loading the {ROLE_NAMES['lang']}")
        eng = TransformersEngine(load_model(ck, arr.trio.device), arr.engines["math"].tokenizer,
                                 batch_size=arr.trio.batch_size, use_chat_template=arr.trio.chat_template,
                                 prefix=prefix_of(ck))
    arr.engines["lang"] = eng
    HELD.hold(arr, arr.trio.checkpoints["math"].nbytes + ck.nbytes * (1 + len(kept)))


def _vllm(arr: VLLMArrangement, ck: Checkpoint, progress: Progress) -> None:
    i = next(i for i, roles in enumerate(arr.roles) if "lang" in roles)
    progress(0.2, f"loading the {ROLE_NAMES['lang']} into its engine")
    if i in arr.turns:  # sleep mode: its own engine, woken and reloaded
        turns, by_role = arr.turns[i]
        turns.use(by_role["lang"]).refresh(ck.path)
        arr.engines["lang"] = TurnEngine(turns, by_role["lang"])
    elif len(arr.roles[i]) == 1:  # an engine of its own: reloaded in place
        arr.vllm[i].refresh(ck.path)
        arr.engines["lang"] = arr.vllm[i]
    else:  # an engine shared with other models: swapped in before it answers
        arr.engines["lang"] = SwappedEngine(arr.vllm[i], ck.path)


__all__ = ["switch_lang"]
