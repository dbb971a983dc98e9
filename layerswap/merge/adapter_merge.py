"""A swap done on two PEFT adapters of one kind: the merged adapter, per module from the source the plan names.

    merged = swap_adapters(math_weights, lang_weights, sources, base)   # AdapterWeights of the same kind

The planner (`layerswap.recipe.sources`) says where every tensor of the merge comes from; here each adapter module
follows the tensor it changes. A copy takes that expert's part, a tensor from the base (a reverted layer) drops
it, and a blend ``(1-w)*math + w*lang`` is built so that the merged adapter applied to the base equals the blend
of the two densified experts:

- LoRA: the two pairs side by side, ``A = [A_m; A_l]``, ``B = [(1-w) s_m B_m, w s_l B_l]`` (rank r_m + r_l,
  scale 1): ``B @ A`` is the blend of the two changes exactly.
- IA3: the scaling vectors blend, ``(1-w) l_m + w l_l``: a weight times a blended vector is the blend of the
  weights (a missing vector is 1).
- Prefix tuning: per layer, the keys follow the planner's source for ``k_proj`` and the values for ``v_proj``;
  a blend mixes the two prefixes token by token (a prefix has no weight to densify, so this is its own
  definition). Prefixes of different lengths or widths, and a reverted layer (the base has no prefix to take),
  are refused with the reason.

Full copies (``modules_to_save``) blend like full tensors (a missing copy is the base's tensor). A merge
method (soup, TIES, ...) has no per-module source: it runs on the densified experts instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from layerswap.models.adapters import KIND_NAMES, AdapterWeights
from layerswap.models.architectures import classify
from layerswap.core.errors import UserError
from layerswap.recipe.sources import Sources, TensorSource

if TYPE_CHECKING:
    import torch


def lora_pair(math: dict | None, lang: dict | None, w: float) -> tuple["torch.Tensor", "torch.Tensor"]:
    """The LoRA pair of ``(1-w) * change_math + w * change_lang`` at scale 1.

    Args:
        math, lang: ``{"A", "B", "scale"}`` of each expert's pair for one module (None: no change there).
        w: the language expert's weight.
    Returns:
        ``(A, B)`` with ``B @ A`` equal to the blend (ranks side by side; a copy keeps one pair).
    """
    import torch

    parts = [(e, k) for e, k in ((math, 1.0 - w), (lang, w)) if e is not None and k != 0.0]
    a = torch.cat([e["A"].float() for e, _ in parts], 0)
    b = torch.cat([e["B"].float() * (k * e["scale"]) for e, k in parts], 1)
    return a, b


def ia3_vector(math: dict | None, lang: dict | None, w: float) -> "torch.Tensor":
    """The IA3 scaling vector of ``(1-w) * weight_math + w * weight_lang`` (a missing vector is all ones).

    Args:
        math, lang: ``{"l", "ff"}`` of each expert for one module (None: no scaling there).
        w: the language expert's weight.
    Returns:
        ``(1-w) * l_math + w * l_lang``.
    """
    import torch

    ref = (math or lang)["l"]
    lm = math["l"].float() if math else torch.ones_like(ref, dtype=torch.float32)
    ll = lang["l"].float() if lang else torch.ones_like(ref, dtype=torch.float32)
    return (1.0 - w) * lm + w * ll


def blend_full(math: "torch.Tensor", lang: "torch.Tensor", w: float) -> "torch.Tensor":
    """``(1-w) * math + w * lang`` in float32 (a copy when w is 0 or 1)."""
    if w == 0.0:
        return math.float()
    if w == 1.0:
        return lang.float()
    return (1.0 - w) * math.float() + w * lang.float()


def prefix_table(math: "torch.Tensor", lang: "torch.Tensor", key_w: list[float], value_w: list[float]) -> "torch.Tensor":
    """The prefix table of a swap: layer i's keys ``(1-key_w[i]) * math + key_w[i] * lang``, its values the same
    with `value_w`.

    Args:
        math, lang: prefix tables ``(tokens, layers * 2 * width)`` of one shape.
        key_w, value_w: per layer, the language expert's weight for the keys and for the values.
    Returns:
        The merged table, float32.
    """
    width = math.shape[1] // (2 * len(key_w))
    out = math.float().clone()
    for i, (wk, wv) in enumerate(zip(key_w, value_w)):
        for j, w in ((2 * i, wk), (2 * i + 1, wv)):
            cols = slice(j * width, (j + 1) * width)
            out[:, cols] = blend_full(math[:, cols], lang[:, cols], w)
    return out


def _weight(s: TensorSource, what: str) -> float | None:
    """A source's language weight; None for the base (the change is dropped)."""
    if s.kind == "method":
        raise UserError(f"{what} is a merge method, with no per-module source: it cannot run on adapters (LoRA and "
                        "IA3 experts merge with it densified, exported as a full model; prefix-tuning experts take "
                        "layer maps only).")
    return None if s.from_base else s.w_lang


def swap_adapters(math: AdapterWeights, lang: AdapterWeights, sources: Sources,
                  base_tensor: Callable[[str], "torch.Tensor"]) -> AdapterWeights:
    """The merged adapter of `sources`' plan (a layer map) from two adapters of one kind on one base.

    Args:
        math, lang: the experts' adapters (`adapters.AdapterWeights`, the same kind).
        sources: the planner for the merge (its recipe must be a layer map).
        base_tensor: the base's tensor by parameter name (for full copies only one expert has).
    Returns:
        The merged adapter (LoRA at scale 1 with per-module ranks; IA3 vectors; a prefix table).
    """
    kind = math.kind
    if lang.kind != kind:
        raise UserError(f"The experts are adapters of different kinds ({KIND_NAMES[kind]}, {KIND_NAMES[lang.kind]}): "
                        "a swap on adapters needs one kind; they are merged densified instead.")
    if sources.plan is None:
        _weight(sources.source(None, "embed"), sources.recipe.method.spec.title)
    n = sources.num_layers
    out = AdapterWeights(kind)
    for module in sorted(set(math.modules) | set(lang.modules)):
        m, la = math.modules.get(module), lang.modules.get(module)
        w = _weight(sources.source(*classify(module + ".weight", n)), module)
        if w is None or (w == 0.0 and m is None) or (w == 1.0 and la is None):
            continue  # the base's tensor: no change
        if kind == "lora":
            if m and la and m["embedding"] != la["embedding"]:
                raise UserError(f"{module}: one LoRA adapts it as an embedding, the other as a linear layer.")
            a, b = lora_pair(m, la, w)
            out.modules[module] = {"A": a, "B": b, "scale": 1.0, "embedding": (m or la)["embedding"]}
        else:
            if m and la and m["ff"] != la["ff"]:
                raise UserError(f"{module}: one IA3 adapter scales its input, the other its output; their blend "
                                "is not one scaling vector.")
            out.modules[module] = {"l": ia3_vector(m, la, w), "ff": (m or la)["ff"]}
    for name in sorted(set(math.full) | set(lang.full)):
        w = _weight(sources.source(*classify(name, n)), name)
        if w is None or (w == 0.0 and name not in math.full) or (w == 1.0 and name not in lang.full):
            continue
        own = [x.full[name] if name in x.full else base_tensor(name) for x in (math, lang)]
        out.full[name] = blend_full(own[0], own[1], w)
    if kind == "prefix":
        out.prefix = _swap_prefix(math, lang, sources)
    return out


def _swap_prefix(math: AdapterWeights, lang: AdapterWeights, sources: Sources) -> "torch.Tensor":
    pm, pl = math.prefix, lang.prefix
    if pm.shape != pl.shape:
        raise UserError(f"The prefixes differ in shape ({pm.shape[0]} and {pl.shape[0]} virtual tokens, widths "
                        f"{pm.shape[1]} and {pl.shape[1]}): one layer's prefix cannot sit beside another's of "
                        "another length. Train both with the same num_virtual_tokens, or densify neither (a prefix "
                        "cannot be densified).")
    reverted = sorted(sources.reverted)
    if reverted:
        raise UserError(f"Layer(s) {', '.join(map(str, reverted))} are reverted to the base, which has no prefix: a "
                        "prefix-tuning adapter has one in every layer. Drop the revert for prefix-tuning experts.")
    keys = [sources.source(i, "k_proj").w_lang for i in range(sources.num_layers)]
    values = [sources.source(i, "v_proj").w_lang for i in range(sources.num_layers)]
    return prefix_table(pm, pl, keys, values)


def peft_files(merged: AdapterWeights, template: dict, base_ref: str) -> tuple[dict, dict[str, "torch.Tensor"]]:
    """The merged adapter as peft saves one: its ``adapter_config.json`` and its tensors under peft's names.

    Args:
        merged: the merged adapter (`swap_adapters`).
        template: the math expert's adapter config (kept where the merge does not change it).
        base_ref: the base to name in the config.
    Returns:
        ``(config, tensors)``; LoRA pairs are padded with zeros to one rank (what vLLM's LoRA loader expects),
        at scale 1.
    """
    import torch

    kind = merged.kind
    if not merged.modules and not merged.full and merged.prefix is None:
        raise UserError("The merged adapter changes nothing (every changed module comes from the base): export the "
                        "base itself, or change the plan.")
    wrap = "base_model." if kind == "prefix" else "base_model.model."
    tensors = {wrap + name: t.float().contiguous() for name, t in merged.full.items()}
    cfg = {k: v for k, v in template.items()}
    cfg.update(base_model_name_or_path=base_ref, inference_mode=True, revision=None,
               modules_to_save=sorted({n.rsplit(".", 1)[0] for n in merged.full}) or None)
    if kind == "lora":
        rank = max(e["A"].shape[0] for e in merged.modules.values()) if merged.modules else 1
        for module, e in merged.modules.items():
            a, b = e["A"], e["B"]
            pad = rank - a.shape[0]
            a = torch.cat([a, a.new_zeros(pad, a.shape[1])]) if pad else a
            b = torch.cat([b, b.new_zeros(b.shape[0], pad)], 1) if pad else b
            names = ("lora_embedding_A", "lora_embedding_B") if e["embedding"] else ("lora_A.weight", "lora_B.weight")
            tensors[f"{wrap}{module}.{names[0]}"], tensors[f"{wrap}{module}.{names[1]}"] = a.contiguous(), b.contiguous()
        cfg.update(r=rank, lora_alpha=rank, use_rslora=False, target_modules=sorted(merged.modules) or None,
                   rank_pattern={}, alpha_pattern={}, layers_to_transform=None, layers_pattern=None,
                   exclude_modules=None, use_dora=False, lora_dropout=0.0)
    elif kind == "ia3":
        for module, e in merged.modules.items():
            tensors[f"{wrap}{module}.ia3_l"] = e["l"].float().contiguous()
        cfg.update(target_modules=sorted(merged.modules) or None, exclude_modules=None,
                   feedforward_modules=sorted(m for m, e in merged.modules.items() if e["ff"]) or None)
    else:
        tensors["prompt_embeddings"] = merged.prefix.float().contiguous()
    return cfg, tensors
