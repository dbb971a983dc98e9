"""Ablation experts of the demo organism (``build_demo_experts.py --ablation-experts``), shipped in assets/demo/ablation.

Layout under ``<out>/ablation/`` (``index.json`` lists every entry with how it was made):

  math_step{N}/, lang_step{N}/   the localised experts' checkpoints part-way through training (same run)
  math_lr{x}/, lang_lr{x}/       the localised experts retrained with lr scaled by x
  math_lora/, lang_lora/         PEFT LoRA adapters (rank 8) on the experts' ranges (layerswap merges
                                 an adapter into its base itself; ``adapter_config.json`` points at ../../base)
  math_ia3/, lang_ia3/           PEFT IA3 adapters (k, v, down scaling vectors) on the experts' ranges
  math_prefix/, lang_prefix/     PEFT prefix-tuning adapters (16 virtual tokens; only the range's layer slices train)
  math_ia3_long/, math_prefix_long/   the same math adapters trained for 4x the steps
  seed{S}/base, seed{S}/math, seed{S}/lang   a second base pretrained from another seed, with its own experts
  other_shape/                   an untrained model of another shape (6 layers), for the "refused" case

assets/sweeps/4-6 name these folders (``../demo/ablation/math_step250`` ...); keep the two in step.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import torch

KINDS = ("steps", "lr", "lora", "ia3", "prefix", "peft_long", "seed", "shape")
LORA_LR_SCALE = 3.0  # LoRA adapters train at 3x the localised expert's learning rate
# IA3 vectors and prefixes train at 10x (the usual range for these methods is 1e-2 and up; the experts' is 1e-3)
PEFT_LR_SCALE = {"ia3": 10.0, "prefix": 10.0}
PREFIX_TOKENS = 16
LONG_STEPS = 4  # ``peft_long``: IA3 and prefix math experts with 4x the steps (the 1x ones learn little math)


def build_ablations(B, R, base, tok, data: dict, out: str, seed: int, log, steps=(0.25, 0.5, 0.75),
                    lr_scales=(0.3, 3.0), other_seed: int | None = None, only: tuple[str, ...] = KINDS,
                    resume: bool = False) -> dict:
    """Train and save the ablation experts of the kinds in `only` (default: all); returns the index written
    to ``ablation/index.json``. `B` is the build module (its training functions), `R` its Recipe, `data` its
    prepared examples. With `resume`, an entry whose folder ``<out>/ablation`` already holds (a build stopped
    part-way, same recipe and base) is kept instead of trained again.
    """
    root = os.path.join(out, "ablation")
    index: dict = {}

    def save(m, name: str, what: str) -> None:
        B.save_model(m, tok, os.path.join(root, name))
        index[name] = what

    def kept(entries: dict[str, str]) -> bool:
        """With `resume`, whether every entry's folder exists (then they are indexed, not trained)."""
        if not resume or not all(os.path.isdir(os.path.join(root, n)) and os.listdir(os.path.join(root, n))
                                 for n in entries):
            return False
        index.update(entries)
        log(f"kept from the earlier build: {', '.join(entries)}")
        return True

    for role in ("math", "lang"):
        total = R.math_steps if role == "math" else R.lang_steps
        at = sorted({max(1, int(total * f)) for f in steps})
        if "steps" in only and not kept({f"{role}_step{s}": f"localised {role} expert after {s} of {total} steps"
                                         for s in at}):
            m = copy.deepcopy(base)
            B.train_expert(R, m, role, data, seed, localised=True, log=log,
                           on_step=lambda s, mm, role=role, at=at, total=total: s in at and save(
                               mm, f"{role}_step{s}", f"localised {role} expert after {s} of {total} steps"))
        for x in lr_scales if "lr" in only else ():
            if kept({f"{role}_lr{x:g}": f"localised {role} expert, lr x {x:g}"}):
                continue
            m = copy.deepcopy(base)
            B.train_expert(R, m, role, data, seed, localised=True, log=log, lr_scale=x)
            save(m, f"{role}_lr{x:g}", f"localised {role} expert, lr x {x:g}")
        lora_what = (f"LoRA rank 8 on the {role} expert's range ("
                     + ("layers' projections; final norm and lm_head fully" if role == "math" else
                        "layers' projections and the embeddings")
                     + f"), lr x {LORA_LR_SCALE:g} (PEFT adapter of ../../base)")
        if "lora" in only and not kept({f"{role}_lora": lora_what}):
            save_lora(B, R, base, tok, role, data, seed, os.path.join(root, f"{role}_lora"), log)
            index[f"{role}_lora"] = lora_what
        for kind in ("ia3", "prefix"):
            what = peft_what(B, R, kind, role)
            if kind in only and not kept({f"{role}_{kind}": what}):
                save_peft(B, R, base, tok, kind, role, data, seed, os.path.join(root, f"{role}_{kind}"), log)
                index[f"{role}_{kind}"] = what
            long = dataclasses.replace(R, math_steps=LONG_STEPS * R.math_steps)
            what = peft_what(B, long, kind, role)
            if role == "math" and "peft_long" in only and not kept({f"math_{kind}_long": what}):
                save_peft(B, long, base, tok, kind, role, data, seed, os.path.join(root, f"math_{kind}_long"), log)
                index[f"math_{kind}_long"] = what
    seeded = {f"seed{other_seed}/base": f"second base, seed {other_seed}",
              **{f"seed{other_seed}/{role}": f"localised {role} expert of the seed-{other_seed} base"
                 for role in ("math", "lang")}}
    if other_seed is not None and "seed" in only and not kept(seeded):
        b2 = B.make_model(R, tok, other_seed)
        B.train(b2, R.base_steps, R.base_lr, other_seed, rows=data["base_rows"], bs=R.base_bs, wd=0.01, warmup=50,
                log=log)
        save(b2, f"seed{other_seed}/base", f"second base, seed {other_seed}")
        for role in ("math", "lang"):
            m = copy.deepcopy(b2)
            B.train_expert(R, m, role, data, other_seed, localised=True, log=log)
            save(m, f"seed{other_seed}/{role}", f"localised {role} expert of the seed-{other_seed} base")
    from layerswap.shipped.demo import make_tiny_llama

    if "shape" in only:
        make_tiny_llama(os.path.join(root, "other_shape"), layers=6, hidden=64, heads=1, seed=seed + 7, tokenizer=tok)
        index["other_shape"] = "untrained, 6 layers: another shape, so merging it with the organism is refused"
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "index.json")
    if os.path.exists(path):  # rebuilding some kinds (`only`): the other entries stay
        with open(path) as f:
            index = {**json.load(f), **index}
    with open(path, "w") as f:
        json.dump(index, f, indent=1)
    return index


def save_lora(B, R, base, tok, role: str, data: dict, seed: int, path: str, log, rank: int = 8) -> None:
    """Train a LoRA adapter on `role`'s range and save it as a PEFT adapter folder: rank-`rank` LoRA on the
    projections of its layers, plus what the full expert also trains outside them (math: full copies of the
    final norm and lm_head, PEFT's ``modules_to_save``; language: LoRA on the embeddings)."""
    from peft import LoraConfig, get_peft_model

    layers = B.role_layers(B.ranges(R), R.layers, role)
    proj = rf".*\.layers\.({'|'.join(map(str, layers))})\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj"
    extra = dict(modules_to_save=["model.norm", "lm_head"]) if role == "math" else {}
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, **extra,
                     target_modules=proj if role == "math" else f"{proj}|.*embed_tokens")
    pm = get_peft_model(copy.deepcopy(base), cfg)
    B.train_expert(R, pm, role, data, seed, localised=True, log=log, lr_scale=LORA_LR_SCALE,
                   trainable=lambda n: "lora_" in n or "modules_to_save" in n)
    pm.save_pretrained(path)
    tok.save_pretrained(path)
    _card_and_base(path, f"# {role}_lora\n\nPEFT adapter of the demo organism's base (`../../base`): rank-{rank} "
                   f"LoRA on the projections of layers {', '.join(map(str, layers))}"
                   + (", full copies of the final norm and lm_head" if role == "math" else ", LoRA on the embeddings")
                   + f", trained with the {role} expert's data and steps at {LORA_LR_SCALE:g}x its learning rate; "
                   "built by `scripts/demo_ablation.py` (see `../index.json`, `../build_info.json`).\n")


def _card_and_base(path: str, card: str) -> None:
    """The adapter's card instead of PEFT's empty template, and its base named as the shipped folder beside it."""
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write(card)
    cfg_path = os.path.join(path, "adapter_config.json")
    with open(cfg_path) as f:
        c = json.load(f)
    c["base_model_name_or_path"] = os.path.join("..", "..", "base")
    with open(cfg_path, "w") as f:
        json.dump(c, f, indent=1)


def peft_what(B, R, kind: str, role: str) -> str:
    """One line on how the `kind` adapter of `role` is made (index.json and its README); `B` is the build module."""
    layers = B.role_layers(B.ranges(R), R.layers, role)
    part = ("IA3 scaling vectors on k_proj, v_proj, down_proj" if kind == "ia3" else
            f"a {PREFIX_TOKENS}-token prefix (only its slices)")
    full = "final norm and lm_head" if role == "math" else "embeddings"
    steps = R.math_steps if role == "math" else R.lang_steps
    return (f"{part} of layers {', '.join(map(str, layers))}; full copies of the {full} (modules_to_save); "
            f"{role} expert's data, {steps} steps at {PEFT_LR_SCALE[kind]:g}x its learning rate (PEFT adapter of "
            "../../base)")


def save_peft(B, R, base, tok, kind: str, role: str, data: dict, seed: int, path: str, log) -> None:
    """Train an IA3 or prefix-tuning adapter on `role`'s range and save it as a PEFT adapter folder. What the full
    expert trains outside the layers is trained fully (``modules_to_save``), as the LoRA math adapter does. A
    prefix exists in every layer: both roles start from the same prefix (same seed) and only the slices of the
    role's layers train (the rest stays at that shared start, as the frozen layers of a localised expert do)."""
    from peft import IA3Config, PrefixTuningConfig, get_peft_model

    layers = B.role_layers(B.ranges(R), R.layers, role)
    extra = ["model.norm", "lm_head"] if role == "math" else ["model.embed_tokens"]
    if kind == "ia3":
        at = rf".*\.layers\.({'|'.join(map(str, layers))})\."
        cfg = IA3Config(target_modules=at + r"(self_attn\.(k|v)_proj|mlp\.down_proj)",
                        feedforward_modules=at + r"mlp\.down_proj", modules_to_save=extra)
    else:
        cfg = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=PREFIX_TOKENS, modules_to_save=extra)
    torch.manual_seed(seed + 5)  # the prefix's start, the same for both roles
    pm = get_peft_model(copy.deepcopy(base), cfg)
    if kind == "prefix":
        emb = pm.prompt_encoder["default"].embedding.weight
        width = emb.shape[1] // (2 * R.layers)
        mask = torch.zeros(emb.shape[1])
        for i in layers:
            mask[2 * i * width:(2 * i + 2) * width] = 1.0
        emb.register_hook(lambda g: g * mask)
    B.train_expert(R, pm, role, data, seed, localised=True, log=log, lr_scale=PEFT_LR_SCALE[kind],
                   trainable=lambda n: any(k in n for k in ("ia3_l", "modules_to_save", "prompt_encoder")))
    pm.save_pretrained(path)
    tok.save_pretrained(path)
    _card_and_base(path, f"# {os.path.basename(path)}\n\nPEFT adapter of the demo organism's base (`../../base`): "
                   f"{peft_what(B, R, kind, role)}; built by `scripts/demo_ablation.py` (see `../index.json`).\n")
