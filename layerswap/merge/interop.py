"""mergekit interoperability: any layer-swap or per-layer-map plan as a mergekit YAML config.

The config uses mergekit's ``linear`` method with ``normalize: false`` and one output slice per
run of layers with equal weights: a single source with weight 1 where a layer is copied, both
experts with weights ``1-w`` and ``w`` where it is blended, and per-module filters when a plan
covers only attention or only the MLP. Zero-length slices at both ends pin the embeddings
(first slice) and the final norm / lm_head (last slice) to the plan's non-layer weights; both
always list the two experts, because mergekit takes the number of inputs of the post-weights
from the first slice. Layers a plan reverts are slices with the base model as their only source
(weight 1), so the config then needs the base. Which source each layer and non-layer tensor takes
is the planner's answer (`layerswap.recipe.sources`), as for the merge itself. layerswap's blend uses mergekit's linear arithmetic, so running mergekit
on this file reproduces layerswap's merge bit for bit (up to the sign of exact zeros).
"""

from __future__ import annotations

from layerswap.models.architectures import Architecture
from layerswap.models.checkpoints import Checkpoint
from layerswap.core.errors import UserError
from layerswap.recipe.plans import Plan
from layerswap.recipe.recipes import GIVE_BASE, Recipe, as_recipe
from layerswap.recipe.sources import Sources

_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _ref(ck: Checkpoint) -> str:
    """Hub ids stay ids; local models (and merged adapters) are written as absolute paths."""
    return ck.ref if ck.hub_id and not ck.adapter else str(ck.path)


def _weight(arch: Architecture, value_attn: float, value_mlp: float):
    """A scalar, or mergekit's filtered parameter list when attention and MLP differ."""
    if value_attn == value_mlp:
        return value_attn
    rows = [{"filter": f, "value": value_attn} for f in arch.mergekit_filters("attention")]
    rows += [{"filter": f, "value": value_mlp} for f in arch.mergekit_filters("mlp")]
    return rows


def _sources(arch: Architecture, math: str, lang: str, w_attn: float, w_mlp: float, w_other: float,
             length: tuple[int, int], both: bool = False) -> list[dict]:
    if not both and w_attn == w_mlp == w_other and w_attn in (0.0, 1.0):
        return [{"model": lang if w_attn == 1.0 else math, "layer_range": list(length), "parameters": {"weight": 1.0}}]
    wm = _weight(arch, 1.0 - w_attn, 1.0 - w_mlp)
    wl = _weight(arch, w_attn, w_mlp)
    if isinstance(wm, list):  # tensors in neither group keep the `w_other` split
        wm.append({"value": 1.0 - w_other})
        wl.append({"value": w_other})
    return [
        {"model": math, "layer_range": list(length), "parameters": {"weight": wm}},
        {"model": lang, "layer_range": list(length), "parameters": {"weight": wl}},
    ]


def mergekit_config(math: Checkpoint, lang: Checkpoint, recipe: Recipe | Plan, base: Checkpoint | None = None,
                    refs: tuple[str, ...] | None = None) -> dict:
    """The mergekit YAML config (as a dict) that reproduces `recipe` (a plan, or a soup) with ``linear``.

    `refs` names the (math, language[, base]) models in the config; default: Hub ids, else absolute paths.
    """
    recipe = as_recipe(recipe)
    method, plan = recipe.method, recipe.plan
    L = math.num_layers
    m, lg = (refs or (_ref(math), _ref(lang)))[:2]
    base_ref = refs[2] if refs and len(refs) > 2 else (_ref(base) if base is not None else None)
    dtypes = {t.dtype for t in math.tensors.values()}
    dtype = _DTYPE_NAMES.get(next(iter(dtypes)), "float32") if len(dtypes) == 1 else "float32"
    if method.name == "soup":  # every tensor, non-layer ones included, at the same weight
        plan = Plan(kind="weights", weights=(method.weight,) * L)
    elif not method.spec.uses_plan:
        raise UserError(
            f"export-yaml writes mergekit's linear method (layer-swap plans, per-layer maps, soups). "
            f"{method.spec.title} is implemented differently across tools, so layerswap does not claim a "
            "mergekit equivalent; use mergekit's own method config for it."
        )
    arch = math.arch
    src = Sources(recipe if plan is recipe.plan else plan, L, arch)  # a soup: its weights as a plan
    recipe.require_base(base is not None, f"the mergekit config takes those layers from the base model, so {GIVE_BASE}")

    def layer_key(i: int) -> tuple:  # attention, MLP, anything else in the layer; or the base
        if src.source(i, arch.attention[0]).from_base:
            return ("base",)
        return tuple(src.source(i, ptype).w_lang for ptype in (arch.attention[0], arch.mlp[0], "other"))

    def layer_sources(key: tuple, rng: tuple[int, int]) -> list[dict]:
        if key == ("base",):
            return [{"model": base_ref, "layer_range": list(rng), "parameters": {"weight": 1.0}}]
        return _sources(arch, m, lg, *key, rng)

    slices = [{"sources": _sources(arch, m, lg, *[src.source(None, "embed").w_lang] * 3, (0, 0), both=True)}]
    start = 0
    for i in range(1, L + 1):
        if i == L or layer_key(i) != layer_key(start):
            slices.append({"sources": layer_sources(layer_key(start), (start, i))})
            start = i
    wh = src.source(None, "lm_head").w_lang
    slices.append({"sources": _sources(arch, m, lg, wh, wh, wh, (L, L), both=True)})
    return {
        "merge_method": "linear",
        "base_model": m,
        "slices": slices,
        "parameters": {"normalize": False},
        "dtype": dtype,
        "out_dtype": dtype,
    }


def mergekit_yaml(math: Checkpoint, lang: Checkpoint, recipe: Recipe | Plan, base: Checkpoint | None = None,
                  refs: tuple[str, ...] | None = None) -> str:
    """`mergekit_config` as YAML text, with a comment saying what it reproduces and how to run it."""
    import yaml

    recipe = as_recipe(recipe)
    cfg = mergekit_config(math, lang, recipe, base, refs)
    what = recipe.title()
    head = (f"# mergekit config written by layerswap for: {what}\n"
            "# run: mergekit-yaml this.yml OUT_DIR   (reproduces layerswap's merge bit for bit)\n")
    return head + yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None, width=120)

