"""Running the lens: each model's pass over the prompts, its greedy answer, and the result (JSON as issue 22 fixes it).

    from layerswap.analysis.lens import LensConfig, run_lens
    res = run_lens("math/", "lang/", Plan(b=2, u=0, tb=0, tu=0), base="base/",
                   config=LensConfig("sw", index=3, batch=32), progress=print, cancel=event)
    res.write_json("lens.json"); res.models["merged"].layers[2].alignment

For every model (roles math, lang, merged, base) one pass runs the focus prompt, its English twin
and the batch of parallel questions (`inputs.Batch`); at every layer it keeps the focus prompt's
state at its last position (decoded by the logit lens) and every row's mean-pooled state
(cosine with the twin, linear CKA over the batch). With ``answer_tokens`` the model then answers
the focus prompt greedily (KV cache), and every position of its answer is decoded too.

The lens runs where the one engine decision says the analysis runs (`engines.choice.choose_engines`: on its own,
transformers models on the device asked for; beside a workbench's engines, the plan's `analysis_device`). Models
run in memory when both experts fit in that device's free memory (`core.hardware.current`), else streamed block by
block from their files (`forward`); ``forward="stream"`` or ``"memory"`` forces one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from layerswap.models.checkpoints import Checkpoint, check_compatible
from layerswap.engines.base import load_tokenizer, truncate_at_stop
from layerswap.core.errors import UserError
from layerswap.recipe.plans import Plan
from layerswap.recipe.recipes import Recipe, as_recipe
from layerswap.core.roles import ROLE_NAMES
from layerswap.core.runtime import Progress, no_progress
from layerswap.recipe.sources import Sources, TensorSource
from layerswap.analysis.lens.forward import MergedSource, Stack, WeightSource
from layerswap.analysis.lens.inputs import LensConfig, Prepared, prepare
from layerswap.analysis.lens.metrics import LayerLens, cosine, linear_cka, summarize

if TYPE_CHECKING:
    import torch

ROLES = ("math", "lang", "merged", "base")
FORWARD_CHOICES = ("auto", "memory", "stream")
DECODE_BYTES = 256 * 2**20  # logits decoded at a time
STOPPED = "Stopped: the lens was cancelled; nothing was kept."


@dataclass
class AnswerLens:
    """A model's greedy answer and the lens at each of its positions (column 0: the last prompt token)."""

    text: str
    inputs: list[str]  # the token at each position
    positions: list[list[LayerLens]]  # [position][layer]

    def to_json(self) -> dict:
        return {"text": self.text, "positions": [{"token": tok, "layers": [x.to_json() for x in col]}
                                                  for tok, col in zip(self.inputs, self.positions)]}


@dataclass
class ModelLens:
    role: str
    layers: list[LayerLens]  # state 0 (embeddings) .. L (last block), at the last prompt position
    answer: AnswerLens | None
    streamed: bool
    seconds: float

    @property
    def name(self) -> str:
        return ROLE_NAMES[self.role]


@dataclass
class LensResult:
    """The lens of every model on one prompt; `to_json` gives the issue's schema."""

    prompt: str
    language: str
    language_name: str
    twin: str | None
    index: int | None
    batch_indices: list[int]
    num_layers: int
    rule: str
    recipe: Recipe | None
    models: dict[str, ModelLens]
    last_token: str

    @property
    def layer_sources(self) -> list[TensorSource] | None:
        """Per layer, where the merged model's layer comes from (`sources.Sources`: a reverted layer is the
        base's, whatever the map says); None without a recipe or for a method without a layer map."""
        if self.recipe is None or self.recipe.plan is None:
            return None
        return Sources(self.recipe, self.num_layers).layers()

    def to_json(self) -> dict:
        """``{"prompt", "language", "models": {ROLE: {"layers": [...]}}}``; a role's ``answer`` only when answers
        were lensed."""
        models = {}
        for role, m in self.models.items():
            models[role] = {"layers": [x.to_json() for x in m.layers]}
            if m.answer is not None:
                models[role]["answer"] = m.answer.to_json()
        return {"prompt": self.prompt, "language": self.language, "models": models}

    def write_json(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        return path


# ---- one model --------------------------------------------------------------------------------------

class _Ticker:
    """Progress over a known number of blocks, checking `cancel` before each."""

    def __init__(self, progress: Progress, cancel: threading.Event | None, total: int, lo: float, hi: float, what: str):
        self.progress, self.cancel, self.total, self.lo, self.hi, self.what = progress, cancel, total, lo, hi, what
        self.done = 0

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise UserError(STOPPED)

    def __call__(self, block: int) -> None:
        self.check()
        self.progress(self.lo + (self.hi - self.lo) * min(self.done / max(self.total, 1), 1.0),
                      f"{self.what}: layer {block}")
        self.done += 1


def _decode(stack: Stack, states: "torch.Tensor", prep: Prepared) -> list[LayerLens]:
    """Rows of states, decoded a bounded number at a time; row r is layer r mod (L+1)."""
    rows = max(1, DECODE_BYTES // (4 * stack.vocab_size))
    out: list[LayerLens] = []
    for s in range(0, states.shape[0], rows):
        out += summarize(stack.decode(states[s:s + rows]), prep.classes, prep.config.top)
    for r, row in enumerate(out):
        row.layer = r % (stack.num_layers + 1)
    return out


def _pass(stack: Stack, prep: Prepared, tick: _Ticker) -> tuple["torch.Tensor", "torch.Tensor"]:
    """One pass over the batch: the focus row's last-position states ((L+1) x H) and pooled states ((L+1) x S x H)."""
    import torch

    b = prep.batch
    L = stack.num_layers
    last: list = [None] * (L + 1)
    pooled: list = [None] * (L + 1)

    def on_layer(i: int, h: "torch.Tensor") -> None:
        h = h.float()
        last[i] = h[b.focus, b.last[b.focus]].cpu()
        pooled[i] = torch.einsum("st,sth->sh", b.pool.to(h.device), h).cpu()

    stack.forward(b.ids, b.mask, on_layer, on_block=tick)
    return torch.stack(last), torch.stack(pooled)


def _answer(stack: Stack, prep: Prepared, tick: _Ticker) -> tuple[str, list[int], "torch.Tensor"]:
    """Greedy answer of the focus prompt (the final layer's argmax, as generation does) and each step's states."""
    import torch

    tok = prep.encoder.tokenizer
    eos = {tok.eos_token_id} - {None}
    cache = stack.new_cache()
    x = torch.tensor([prep.focus_ids])
    tokens: list[int] = []
    steps = []
    for _ in range(prep.config.answer_tokens):
        cur: dict[int, "torch.Tensor"] = {}
        stack.forward(x, None, lambda i, h: cur.__setitem__(i, h[0, -1].float().cpu()), cache=cache, on_block=tick)
        states = torch.stack([cur[i] for i in range(stack.num_layers + 1)])
        steps.append(states)
        nxt = int(stack.decode(states[-1:]).argmax(-1))
        tokens.append(nxt)
        text = tok.decode(tokens, skip_special_tokens=True)
        if nxt in eos or truncate_at_stop(text, prep.stop) != text:
            break
        x = torch.tensor([[nxt]])
    text = truncate_at_stop(tok.decode(tokens, skip_special_tokens=True), prep.stop)
    return text, tokens, torch.stack(steps)


def lens_model(stack: Stack, role: str, prep: Prepared, *, progress: Progress = no_progress,
               cancel: threading.Event | None = None, span: tuple[float, float] = (0.0, 1.0),
               streamed: bool = False) -> tuple[ModelLens, "torch.Tensor"]:
    """The lens of one model, and its pooled states ((L+1) x S x H, to compare models or twins)."""
    t0 = time.perf_counter()
    L = stack.num_layers
    tick = _Ticker(progress, cancel, L * (1 + prep.config.answer_tokens), span[0], span[1], ROLE_NAMES[role])
    tick.check()
    last, pooled = _pass(stack, prep, tick)
    layers = _decode(stack, last, prep)
    b = prep.batch
    for i, row in enumerate(layers):
        if b.twin is not None:
            row.alignment = round(cosine(pooled[i, b.focus], pooled[i, b.twin]), 6)
        cka = linear_cka(pooled[i, b.cka_target], pooled[i, b.cka_english])
        row.cka = None if cka is None else round(cka, 6)
    answer = None
    if prep.config.answer_tokens:
        text, tokens, steps = _answer(stack, prep, tick)
        flat = _decode(stack, steps.reshape(-1, steps.shape[-1]), prep)
        cols = [flat[j * (L + 1):(j + 1) * (L + 1)] for j in range(steps.shape[0])]
        texts = prep.classes.texts
        inputs = [texts[prep.focus_ids[-1]] if prep.focus_ids[-1] < len(texts) else "?"]
        inputs += [texts[t] if t < len(texts) else f"<id {t}>" for t in tokens[:len(cols) - 1]]
        answer = AnswerLens(text, inputs, cols)
    return ModelLens(role, layers, answer, streamed, round(time.perf_counter() - t0, 3)), pooled


# ---- several models ----------------------------------------------------------------------------------

StackFactory = Callable[[], Stack]


def lens_stacks(stacks: dict[str, StackFactory], tokenizer, config: LensConfig, *, recipe: Recipe | Plan | None = None,
                streamed: dict[str, bool] | None = None, progress: Progress | None = None,
                cancel: threading.Event | None = None) -> LensResult:
    """The lens of each model (`stacks`: role -> a function that builds its `Stack`, called in turn so that
    in-memory models can be released between roles)."""
    p = progress or no_progress
    roles = [r for r in ROLES if r in stacks]
    if not roles:
        raise UserError("The lens needs at least one model.")
    recipe = as_recipe(recipe) if recipe is not None else None
    results: dict[str, ModelLens] = {}
    prep = None
    L = None
    for k, role in enumerate(roles):
        if cancel is not None and cancel.is_set():
            raise UserError(STOPPED)
        p(k / len(roles), f"preparing the {ROLE_NAMES[role]}")
        stack = stacks[role]()
        if prep is None:
            L = stack.num_layers
            if recipe is not None:
                recipe.validate(L)
            p(k / len(roles), "reading the MGSM prompts and token classes")
            prep = prepare(config, tokenizer, stack.vocab_size)
        results[role], _ = lens_model(stack, role, prep, progress=p, cancel=cancel,
                                      span=(k / len(roles), (k + 1) / len(roles)),
                                      streamed=bool((streamed or {}).get(role)))
        del stack
    p(1.0, "done")
    texts = prep.classes.texts
    last = prep.focus_ids[-1]
    return LensResult(prep.prompt, config.language, prep.language_name, prep.twin, config.index, prep.batch_indices,
                      L, prep.classes.summary(), recipe, results, texts[last] if last < len(texts) else "?")


def choose_forward(forward: str, device: str, *checkpoints: Checkpoint) -> str:
    """``memory`` or ``stream``: auto keeps the models in memory when the experts fit in 80 % of the device's free
    memory (the merged model shares their tensors), and streams them otherwise."""
    from layerswap.core.hardware import current

    if forward not in FORWARD_CHOICES:
        raise UserError(f"Unknown forward mode {forward!r}; use {', '.join(FORWARD_CHOICES)}.")
    if forward != "auto":
        return forward
    need = sum(ck.nbytes for ck in checkpoints[:2]) + max((ck.nbytes for ck in checkpoints), default=0) // 2
    have = current().memory_available("cuda" if device.startswith("cuda") else "cpu")
    return "memory" if need <= 0.8 * have else "stream"


def run_lens(math: Checkpoint | str, lang: Checkpoint | str, recipe: Recipe | Plan | None = None, *,
             config: LensConfig, base: Checkpoint | str | None = None, device: str = "auto", forward: str = "auto",
             roles: tuple[str, ...] = ROLES, progress: Progress | None = None,
             cancel: threading.Event | None = None) -> LensResult:
    """The lens of math expert, language expert, their merge (`recipe`; default: `default_plan` for the
    depth) and the base (when given) on `config`'s prompt. Models are folders / Hub ids or Checkpoints;
    PEFT adapters as experts are merged into their base first. `device`: asked of the one engine decision
    (`engines.choice.choose_engines`, for transformers models). `progress(fraction, text)` follows the
    layers; setting `cancel` stops before the next block (UserError)."""
    from layerswap.engines import choice
    from layerswap.models.adapters import open_expert

    base_ck = base if isinstance(base, Checkpoint) or base is None else Checkpoint.open(base)
    math_ck = math if isinstance(math, Checkpoint) else open_expert(math, base)
    lang_ck = lang if isinstance(lang, Checkpoint) else open_expert(lang, base)
    check_compatible(math_ck, lang_ck, base_ck).raise_if_bad()
    L = math_ck.num_layers
    recipe = as_recipe(recipe) if recipe is not None else Recipe.from_values(num_layers=L)
    recipe.validate(L)
    if "merged" in roles:
        recipe.require_base(base_ck is not None)
    config.validate()
    asked = choice.EngineSettings(engine="transformers", device=device)
    device = choice.choose_engines(asked, {"model": math_ck}).analysis_device
    mode = choose_forward(forward, device, math_ck, lang_ck, *([base_ck] if base_ck else []))
    tokenizer = load_tokenizer(math_ck.path)
    cks = {"math": math_ck, "lang": lang_ck, "base": base_ck}
    wanted = [r for r in roles if r in ROLES and (r != "base" or base_ck is not None)]
    if mode == "stream":
        stacks: dict[str, StackFactory] = {
            r: (lambda r=r: Stack.streamed(MergedSource(math_ck, lang_ck, recipe, base_ck) if r == "merged"
                                           else WeightSource(cks[r]), device)) for r in wanted}
    else:
        stacks = _memory_stacks(cks, recipe, wanted, device)
    return lens_stacks(_with_prefixes(stacks, cks, recipe), tokenizer, config, recipe=recipe,
                       streamed={r: mode == "stream" for r in wanted}, progress=progress, cancel=cancel)


def _with_prefixes(stacks: dict[str, StackFactory], cks: dict, recipe: Recipe) -> dict[str, StackFactory]:
    """Prefix-tuning experts: each model's stack runs with its prefix (the merged one's from the adapters' swap)."""
    from layerswap.models.adapters import prefix_of
    from layerswap.merge.merging import adapter_pair, merged_adapter

    if adapter_pair(cks["math"], cks["lang"]) != "prefix":
        return stacks
    prefixes = {"math": prefix_of(cks["math"]), "lang": prefix_of(cks["lang"]),
                "merged": merged_adapter(cks["math"], cks["lang"], recipe, cks.get("base")).prefix}
    return {r: (lambda f=f, p=prefixes.get(r): f().with_prefix(p)) for r, f in stacks.items()}


def _memory_stacks(cks: dict, recipe: Recipe, roles: list[str], device: str) -> dict[str, StackFactory]:
    """Loaders of in-memory models; the experts stay loaded until the merged model (which shares their tensors) ran."""
    from layerswap.engines import load_model

    held: dict[str, object] = {}

    def expert(role: str):
        if role not in held:
            held[role] = load_model(cks[role], device)
        return held[role]

    def build(role: str) -> Stack:
        if role in ("math", "lang"):
            model = expert(role)
        elif role == "merged":
            model = merged_model(expert("math"), expert("lang"), recipe, cks["math"], cks.get("base"), device)
            held.clear()
        else:
            held.clear()
            model = load_model(cks["base"], device)
        return Stack.loaded(model)

    return {r: (lambda r=r: build(r)) for r in roles}


def merged_model(math_model, lang_model, recipe: Recipe, math_ck: Checkpoint, base: Checkpoint | None, device: str):
    """The merge of two loaded experts by `merging.merge_in_memory` (copied tensors are shared), as the Workbench builds it."""
    from layerswap.engines import model_from_state_dict
    from layerswap.merge.merging import merge_in_memory

    sd = merge_in_memory(math_model.state_dict(), lang_model.state_dict(), math_ck.num_layers, recipe,
                         base=(lambda n: base.get(n, device)) if base is not None else None, arch=math_ck.arch)
    return model_from_state_dict(math_model.config, sd, math_model.generation_config).to(device)


def lens_workbench(wb, config: LensConfig, *, recipe: Recipe | None = None, progress: Progress | None = None,
                   cancel: threading.Event | None = None) -> LensResult:
    """The lens of a `Workbench`'s models for `recipe` (default: the built one): the transformers models it has
    loaded as they are (the merged one when it holds `recipe`); everything else (models served by vLLM, models
    not loaded at all, the base) streamed from the files on the workbench's analysis device (its engine plan's
    `analysis_device`: the CPU when the GPU's headroom beside the engines is short), so it needs no engine."""
    from layerswap.engines import TransformersEngine

    if "math" not in wb.checkpoints:
        raise UserError("Load the two experts first.")
    recipe = recipe or wb.recipe
    if recipe is None:
        raise UserError("Give a plan: the lens compares the merged model with the experts.")
    built = wb.holds(recipe)
    cks, device = wb.checkpoints, wb.analysis_device
    stacks: dict[str, StackFactory] = {}
    streamed: dict[str, bool] = {}
    for role in ROLES:
        eng = wb.engines.get(role)
        streamed[role] = not isinstance(eng, TransformersEngine) or (role == "merged" and not built)
        if not streamed[role]:
            stacks[role] = lambda model=eng.model: Stack.loaded(model)
        elif role == "merged":
            stacks[role] = lambda: Stack.streamed(MergedSource(cks["math"], cks["lang"], recipe, cks.get("base")),
                                                  device)
        elif role in cks:
            stacks[role] = lambda ck=cks[role]: Stack.streamed(WeightSource(ck), device)
    tokenizer = getattr(wb.engines.get("math"), "tokenizer", None) or load_tokenizer(cks["math"].path)
    return lens_stacks(_with_prefixes(stacks, cks, recipe), tokenizer, config, recipe=recipe, streamed=streamed, progress=progress,
                       cancel=cancel)
