"""Ablation experts of the demo organism (``build_demo_experts.py --ablation-experts``), shipped in assets/demo/ablation.

Layout under ``<out>/ablation/`` (``index.json`` lists every entry with how it was made):

  math_step{N}/, lang_step{N}/   the localised experts' checkpoints part-way through training (same run)
  math_lr{x}/, lang_lr{x}/       the localised experts retrained with lr scaled by x
  math_lora/, lang_lora/         PEFT LoRA adapters (rank 8) on the experts' ranges (layerswap merges
                                 an adapter into its base itself; ``adapter_config.json`` points at ../../base)
  seed{S}/base, seed{S}/math, seed{S}/lang   a second base pretrained from another seed, with its own experts
  other_shape/                   an untrained model of another shape (6 layers), for the "refused" case

assets/sweeps/4-6 name these folders (``../demo/ablation/math_step250`` ...); keep the two in step.
"""

from __future__ import annotations

import copy
import json
import os

KINDS = ("steps", "lr", "lora", "seed", "shape")
LORA_LR_SCALE = 3.0  # LoRA adapters train at 3x the localised expert's learning rate


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
    from layerswap.demo import make_tiny_llama

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

    layers = [i for i in range(R.layers) if (R.math_lo <= i < R.math_hi) == (role == "math")]
    proj = rf".*\.layers\.({'|'.join(map(str, layers))})\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj"
    extra = dict(modules_to_save=["model.norm", "lm_head"]) if role == "math" else {}
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, **extra,
                     target_modules=proj if role == "math" else f"{proj}|.*embed_tokens")
    pm = get_peft_model(copy.deepcopy(base), cfg)
    B.train_expert(R, pm, role, data, seed, localised=True, log=log, lr_scale=LORA_LR_SCALE,
                   trainable=lambda n: "lora_" in n or "modules_to_save" in n)
    pm.save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, "README.md"), "w") as f:  # instead of PEFT's empty template card
        f.write(f"# {role}_lora\n\nPEFT adapter of the demo organism's base (`../../base`): rank-{rank} LoRA on the "
                f"projections of layers {', '.join(map(str, layers))}"
                + (", full copies of the final norm and lm_head" if role == "math" else ", LoRA on the embeddings")
                + f", trained with the {role} expert's data and steps at {LORA_LR_SCALE:g}x its learning rate; built "
                "by `scripts/demo_ablation.py` (see `../index.json`, `../build_info.json`).\n")
    cfg_path = os.path.join(path, "adapter_config.json")
    with open(cfg_path) as f:
        c = json.load(f)
    c["base_model_name_or_path"] = os.path.join("..", "..", "base")
    with open(cfg_path, "w") as f:
        json.dump(c, f, indent=1)
