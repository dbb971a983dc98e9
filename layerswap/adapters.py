"""PEFT (LoRA) adapters as experts: merged into their base once, cached, then used as full models."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from .cache import cache_dir, fingerprint
from .checkpoints import Checkpoint, is_adapter, resolve
from .errors import UserError


def open_expert(ref: str | os.PathLike, base: str | os.PathLike | None = None) -> Checkpoint:
    """Open an expert: a full model as is, a PEFT adapter merged into its base first (cached).

    `base` overrides the adapter's ``base_model_name_or_path``; it is ignored for full models.
    """
    path = resolve(ref)
    if not is_adapter(path):
        return Checkpoint.from_folder(path, ref)
    merged, base_path = merge_adapter(path, base)
    ck = Checkpoint.open(merged)
    ck.ref, ck.adapter, ck.adapter_base = str(ref), str(path), str(base_path)
    return ck


def merge_adapter(adapter_dir: str | os.PathLike, base: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Merge a PEFT adapter into its base (``merge_and_unload``) and save it as a safetensors model.

    The base is `base` if given, else the adapter's ``base_model_name_or_path``. The result is
    cached under ``$LAYERSWAP_CACHE/adapters-merged`` keyed by the adapter's and base's files.
    Returns the merged folder and the base's folder.
    """
    adapter_dir = Path(adapter_dir)
    try:
        cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{adapter_dir}/adapter_config.json is not valid JSON ({e}).") from None
    if list(adapter_dir.glob("adapter_model.bin")) and not list(adapter_dir.glob("adapter_model.safetensors")):
        raise UserError(f"{adapter_dir} holds a pickle adapter (adapter_model.bin); save it with safetensors.")
    base_ref = str(base) if base else cfg.get("base_model_name_or_path")
    if not base_ref:
        raise UserError(f"{adapter_dir} does not name its base model; pass --base (the model the adapter was trained on).")
    base_path = resolve(base_ref)
    base_ck = Checkpoint.open(base_path)  # validates the base (no pickles, readable headers)
    own = [f for f in adapter_dir.iterdir() if f.is_file() and f.suffix in (".safetensors", ".json", ".bin")]
    key = hashlib.sha256(f"{fingerprint(own)}:{base_ck.fingerprint()}".encode()).hexdigest()[:20]
    out = cache_dir("adapters-merged") / key
    if (out / "config.json").exists():
        return out, base_path
    try:
        from peft import PeftModel
    except ImportError:
        raise UserError("Adapters need peft: pip install 'layerswap[lora]' (or pip install peft).") from None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_path), dtype="auto", use_safetensors=True)
    try:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    except Exception as e:
        raise UserError(f"Could not apply adapter {adapter_dir} to {base_ref} ({type(e).__name__}: {e}).") from None
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        for f in base_ck.tokenizer_files():
            shutil.copy2(f, tmp / f.name)
        for f in adapter_dir.iterdir():  # an adapter's own tokenizer files win
            if f.name.startswith(("tokenizer", "special_tokens_map", "chat_template")):
                shutil.copy2(f, tmp / f.name)
        (tmp / "layerswap-adapter.json").write_text(json.dumps({"adapter": str(adapter_dir), "base": base_ref}))
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(tmp)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, base_path
