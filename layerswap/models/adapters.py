"""PEFT adapters as experts: LoRA, IA3 and prefix tuning, read from their folders, densified into their base.

    ad = read_adapter("lang_lora/")        # kind, config, base; ad.weights(): per module, what it changes
    ck = open_expert("lang_lora/", base)   # the adapter as an expert: a Checkpoint of its densified model

LoRA and IA3 adapters are changes to weights: `open_expert` merges them into their base once (peft's
``merge_and_unload``, cached), and the result is an ordinary expert for every view. A prefix-tuning adapter
changes no weight: it adds a key/value prefix to every layer's attention. Its expert is the base with the
adapter's full copies (``modules_to_save``) written in, plus the prefix (`Checkpoint.adapter_kind` is
``prefix``; the engines read the prefix with `prefix_of`); its weight statistics show only those copies.
A swap of two adapters of one kind, done on the adapters themselves, is `layerswap.merge.adapter_merge`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from layerswap.core.bounds import LORA_ALPHA, MAX_LAYERS
from layerswap.models.cache import cache_dir, content_fingerprint
from layerswap.models.checkpoints import Checkpoint, is_adapter, resolve
from layerswap.core.errors import UserError
from layerswap.core.jsonfile import read_json
from layerswap.models.patterns import HINT, check_name, check_pattern, pattern_routes
from layerswap.models.tensorfile import read_tensors

if TYPE_CHECKING:
    import torch

KINDS = {"LORA": "lora", "IA3": "ia3", "PREFIX_TUNING": "prefix"}
KIND_NAMES = {"lora": "LoRA", "ia3": "IA3", "prefix": "prefix tuning"}
MAX_RANK = 4096  # LoRA ranks and prefix lengths beyond this are refused before anything is allocated
MAX_PATTERNS = 100_000  # characters of module names and patterns in a config
MAX_CONFIG_ROUTES = 256  # routes of all of a config's patterns together (`patterns.MAX_ROUTES` each)
WEIGHTS = "adapter_model.safetensors"
_LORA_PARTS = {"lora_A.weight": "A", "lora_B.weight": "B", "lora_embedding_A": "A", "lora_embedding_B": "B"}


@dataclass
class AdapterWeights:
    """What an adapter changes, by module of the model it adapts (names as in the base, e.g.
    ``model.layers.3.self_attn.q_proj``): LoRA ``{"A", "B", "scale", "embedding"}`` (the change is
    ``scale * B @ A``, transposed for an embedding), IA3 ``{"l", "ff"}`` (the weight times `l`, on its input
    when `ff`), the full copies (``modules_to_save``, by parameter name) and the prefix table
    (``(virtual tokens, layers * 2 * width)``: layer i's keys then values in columns ``2i*width .. (2i+2)*width``)."""

    kind: str
    modules: dict[str, dict] = field(default_factory=dict)
    full: dict[str, "torch.Tensor"] = field(default_factory=dict)
    prefix: "torch.Tensor | None" = None


@dataclass(frozen=True)
class Adapter:
    """A PEFT adapter folder: its kind (``lora``, ``ia3``, ``prefix``), config and the base it names."""

    path: Path
    kind: str
    config: dict

    @property
    def base_ref(self) -> str | None:
        """The base it names: a Hub id, or a folder (a relative one is read from the adapter's folder when it
        is there: ``./`` or ``../``, as peft's own ``../base`` layouts are meant)."""
        ref = self.config.get("base_model_name_or_path") or None
        if ref and ref.startswith(("./", "../")) and (self.path / ref).is_dir():  # never a Hub id's shape
            return str((self.path / ref).resolve())
        return ref

    @property
    def title(self) -> str:
        return KIND_NAMES[self.kind]

    def weights(self) -> AdapterWeights:
        """Its tensors by module (`AdapterWeights`), names stripped of PEFT's wrappers; refused with the reason
        when a variant is not a plain sum of per-module changes (DoRA, LoRA biases, layer replication)."""
        return adapter_weights(self.kind, self.config, read_tensors(self.path / WEIGHTS))


def read_adapter(path: str | os.PathLike) -> Adapter:
    """The adapter in folder `path` (safetensors weights, a PEFT type layerswap reads), its config checked."""
    path = Path(path)
    cfg = read_json(path / "adapter_config.json", where=f"{path}/adapter_config.json",
                    fix="re-save the adapter with peft's save_pretrained")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("base_model_name_or_path") or "", str):
        raise UserError(f"{path}/adapter_config.json is not a JSON object naming its base (a string).")
    if (path / "adapter_model.bin").exists() and not (path / WEIGHTS).exists():
        raise UserError(f"{path} holds a pickle adapter (adapter_model.bin); save it with safetensors.")
    if not (path / WEIGHTS).is_file():
        raise UserError(f"{path} has no {WEIGHTS}: save the adapter with peft's save_pretrained.")
    ptype = str(cfg.get("peft_type", ""))
    if ptype not in KINDS:
        raise UserError(f"{path} is a {ptype[:40] or 'PEFT'} adapter; layerswap reads LoRA, IA3 and prefix-tuning "
                        "adapters (merge other kinds into their base with peft, then pass the full model).")
    check_config(cfg, f"{path}/adapter_config.json")
    return Adapter(path, KINDS[ptype], cfg)


def _count(v: object, what: str, top: int, lo: int = 1) -> None:
    """A whole number from `lo` to `top` (a boolean is not a count)."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= top:
        raise UserError(f"{what} must be a whole number from {lo} to {top:,} (got {str(v)[:20]}).")


def _names_or_pattern(v: object, what: str) -> int:
    """A list of module names, or one safe pattern (`patterns.check_pattern`); returns the pattern's routes."""
    if isinstance(v, str):
        check_pattern(v, what)
        return pattern_routes(v)
    if not isinstance(v, list) or len(v) > MAX_LAYERS * 16:
        raise UserError(f"{what} must be a list of module names or one pattern (got a {type(v).__name__}).")
    for name in v:
        check_name(name, what)
    return 0


def check_config(cfg: dict, where: str) -> None:
    """Refuse what peft or layerswap would match without bound or compute with unchecked: every string peft
    matches as a regular expression must be a safe module-name pattern (`layerswap.models.patterns`), names peft
    pastes into one must be plain names; ranks and counts whole numbers (not booleans), alphas finite and in
    `LORA_ALPHA`, layer indices below `MAX_LAYERS`."""
    for key in ("target_modules", "feedforward_modules", "modules_to_save", "alpha_pattern", "rank_pattern",
                "exclude_modules", "layers_pattern", "target_parameters"):
        v = cfg.get(key)  # module names and patterns: peft and layerswap match them as regular expressions
        if v is not None and len(json.dumps(v)) > MAX_PATTERNS:
            raise UserError(f"{where}: {key} is {len(json.dumps(v)):,} characters long; at most "
                            f"{MAX_PATTERNS:,} are read.")
    for key in ("r", "num_virtual_tokens", "num_layers", "token_dim"):
        if cfg.get(key) is not None:
            _count(cfg[key], f"{where}: {key}", max(MAX_RANK, 64 * MAX_LAYERS))
    routes = 0
    for key in ("target_modules", "feedforward_modules", "exclude_modules"):
        if cfg.get(key):
            routes += _names_or_pattern(cfg[key], f"{where}: {key}")
    for key in ("modules_to_save", "target_parameters"):  # peft pastes each into a pattern of its own
        for name in _listed(cfg.get(key), f"{where}: {key}"):
            check_name(name, f"{where}: {key}")
    lp = cfg.get("layers_pattern")
    for name in [lp] if isinstance(lp, str) else _listed(lp, f"{where}: layers_pattern"):
        check_name(name, f"{where}: layers_pattern")
    layers = cfg.get("layers_to_transform")
    for i in [layers] if isinstance(layers, int) else _listed(layers, f"{where}: layers_to_transform"):
        _count(i, f"{where}: layers_to_transform", MAX_LAYERS - 1, lo=0)
    if cfg.get("lora_alpha") is not None:
        _alpha(cfg["lora_alpha"], f"{where}: lora_alpha")
    for key in ("rank_pattern", "alpha_pattern"):
        table = cfg.get(key)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise UserError(f"{where}: {key} must map module patterns to values (got a {type(table).__name__}).")
        for pat, value in table.items():
            routes += pattern_routes(check_pattern(pat, f"{where}: a {key} key"))
            if key == "rank_pattern":
                _count(value, f"{where}: {key}[{pat[:40]!r}]", MAX_RANK)
            else:
                _alpha(value, f"{where}: {key}[{pat[:40]!r}]")
    if routes > MAX_CONFIG_ROUTES:
        raise UserError(f"{where}: its patterns spell {routes:,} module names together (at most "
                        f"{MAX_CONFIG_ROUTES:,}): {HINT}.")


def _listed(v: object, what: str) -> list:
    if v is None:
        return []
    if not isinstance(v, list) or len(v) > MAX_LAYERS * 16:
        raise UserError(f"{what} must be a list (got a {type(v).__name__}).")
    return v


def _alpha(v: object, what: str) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not -1e300 < v < 1e300 or v not in LORA_ALPHA:
        raise UserError(f"{what} must be a number in {LORA_ALPHA.text()} (got {str(v)[:20]}).")


def check_saved_modules(cfg: dict, base: Checkpoint, where: str) -> None:
    """Each ``modules_to_save`` entry names a module of `base` (peft's rule: a dotted run of its names)."""
    dotted = [f".{name}." for name in base.tensors]
    for m in cfg.get("modules_to_save") or []:
        if not any(f".{m}." in d for d in dotted):
            raise UserError(f"{where}: modules_to_save names {m[:60]!r}, which {base.ref} does not have; "
                            "was the adapter trained on this base?")


def _unwrap(name: str, kind: str) -> str:
    prefix = "base_model." if kind == "prefix" else "base_model.model."
    return name[len(prefix):] if name.startswith(prefix) else name


def _is_feedforward(cfg: dict, module: str) -> bool:
    """peft's rule for an IA3 module: scaled on its input (a feed-forward module) or on its output."""
    ff = cfg.get("feedforward_modules") or []
    if isinstance(ff, str):
        return bool(re.fullmatch(ff, module))
    return any(module.endswith(str(k)) for k in ff)


def lora_scale(cfg: dict, module: str, rank: int) -> float:
    """The factor peft multiplies ``B @ A`` by for `module` (alpha / r, or alpha / sqrt(r) with rsLoRA;
    per-module alphas from ``alpha_pattern``)."""
    alpha = cfg.get("lora_alpha", 8)
    for key, a in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            alpha = a
            break
    return float(alpha) / (rank ** 0.5 if cfg.get("use_rslora") else rank)


def adapter_weights(kind: str, cfg: dict, tensors: dict[str, "torch.Tensor"]) -> AdapterWeights:
    """Group an adapter file's tensors by module (`AdapterWeights`).

    Args:
        kind: ``lora``, ``ia3`` or ``prefix``.
        cfg: the adapter's config (``adapter_config.json``).
        tensors: the adapter file's tensors, with PEFT's names.
    Returns:
        The adapter's changes by module, its full copies and (prefix tuning) its prefix table.
    """
    if kind == "lora" and (cfg.get("use_dora") or cfg.get("lora_bias") or cfg.get("bias", "none") != "none"
                           or cfg.get("layer_replication")):
        raise UserError("This LoRA adapter uses DoRA, biases or layer replication: its change is not B @ A per "
                        "module, so it can only be used densified (merge it into its base with peft first).")
    out = AdapterWeights(kind)
    for raw, t in tensors.items():
        name = _unwrap(raw, kind)
        if ".base_layer." in name:  # peft saves an adapted embedding's own (base) weight beside its pair
            continue
        if kind == "prefix" and name == "prompt_embeddings":
            out.prefix = t
            continue
        part = next((p for p in _LORA_PARTS if name.endswith("." + p)), None) if kind == "lora" else None
        if part is not None:
            module = name[: -len(part) - 1]
            entry = out.modules.setdefault(module, {"embedding": part.startswith("lora_embedding")})
            entry[_LORA_PARTS[part]] = t
        elif kind == "ia3" and name.endswith(".ia3_l"):
            module = name[: -len(".ia3_l")]
            out.modules[module] = {"l": t, "ff": _is_feedforward(cfg, module)}
        else:
            out.full[name] = t
    if kind == "lora":
        for module, e in out.modules.items():
            if "A" not in e or "B" not in e:
                raise UserError(f"The LoRA adapter holds only half of {module}'s pair (A and B): re-save it.")
            e["scale"] = lora_scale(cfg, module, e["A"].shape[0])
    if kind == "prefix" and (out.prefix is None or out.prefix.dim() != 2):
        raise UserError("The prefix-tuning adapter has no prefix table (prompt_embeddings): re-save it with peft.")
    return out


def open_expert(ref: str | os.PathLike, base: str | os.PathLike | None = None) -> Checkpoint:
    """Open an expert: a full model as is, a PEFT adapter densified into its base first (cached).

    `base` overrides the adapter's ``base_model_name_or_path``; it is ignored for full models.
    """
    path = resolve(ref)
    if not is_adapter(path):
        return Checkpoint.from_folder(path, ref)
    ad = read_adapter(path)
    merged, base_path = densify(ad, base)
    ck = Checkpoint.open(merged)
    ck.ref, ck.adapter, ck.adapter_base, ck.adapter_kind = str(ref), str(path), str(base_path), ad.kind
    return ck


def merge_adapter(adapter_dir: str | os.PathLike, base: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """`densify` for an adapter folder: returns the densified folder and the base's folder."""
    return densify(read_adapter(adapter_dir), base)


def densify(ad: Adapter, base: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Write the adapter's densified model as safetensors: LoRA and IA3 merged into the base (peft's
    ``merge_and_unload``), prefix tuning as the base with the adapter's full copies written in.

    The base is `base` if given, else the adapter's ``base_model_name_or_path``. The result is
    cached under ``$LAYERSWAP_CACHE/adapters-merged`` keyed by the adapter's content and the base's files.
    Returns the densified folder and the base's folder.
    """
    base_ref = str(base) if base else ad.base_ref
    if not base_ref:
        raise UserError(f"{ad.path} does not name its base model; pass --base (the model the adapter was trained on).")
    base_path = resolve(base_ref)
    base_ck = Checkpoint.open(base_path)  # validates the base (no pickles, readable headers)
    check_saved_modules(ad.config, base_ck, f"{ad.path}/adapter_config.json")
    own = [f for f in ad.path.iterdir() if f.is_file() and f.suffix in (".safetensors", ".json", ".bin")]
    # the adapter by its bytes: two adapters of one shape can share names, sizes, headers and (a fresh clone, a
    # tarball) mtimes; only their content tells them apart
    key = hashlib.sha256(f"{content_fingerprint(own)}:{base_ck.fingerprint()}".encode()).hexdigest()[:20]
    out = cache_dir("adapters-merged") / key
    if (out / "config.json").exists():
        return out, base_path
    try:
        from peft import PeftModel
    except ModuleNotFoundError as e:
        if e.name != "peft":
            raise  # peft is there but broke on import: the real reason, not an install hint
        raise UserError("Adapters need peft: pip install 'layerswap[lora]' (or pip install peft).") from None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_path), dtype="auto", use_safetensors=True)
    try:
        if ad.kind == "prefix":
            _write_full_copies(model, ad, base_ck)
        else:
            model = PeftModel.from_pretrained(model, str(ad.path)).merge_and_unload()
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"Could not apply adapter {ad.path} to {base_ref} ({type(e).__name__}: {e}).") from None
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        for f in base_ck.tokenizer_files():
            shutil.copy2(f, tmp / f.name)
        for f in ad.path.iterdir():  # an adapter's own tokenizer files win
            if f.name.startswith(("tokenizer", "special_tokens_map", "chat_template")):
                shutil.copy2(f, tmp / f.name)
        (tmp / "layerswap-adapter.json").write_text(json.dumps({"adapter": str(ad.path), "base": base_ref,
                                                                "kind": ad.kind}))
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            shutil.rmtree(tmp)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, base_path


def _write_full_copies(model, ad: Adapter, base_ck: Checkpoint) -> None:
    """Write a prefix adapter's full copies into `model` (in place), shapes checked against the base."""
    import torch

    weights = ad.weights()
    check_prefix(weights, base_ck)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in weights.full.items():
            if name not in params or tuple(params[name].shape) != tuple(t.shape):
                raise UserError(f"{ad.path}: its copy of {name[:80]} does not fit the base {base_ck.ref}.")
            params[name].copy_(t)


def prefix_width(ck: Checkpoint) -> int:
    """The width of one layer's keys (or values) in a prefix table for `ck`: key/value heads x head size."""
    tc = ck.text_config
    heads = int(tc.get("num_attention_heads", 1))
    head_dim = int(tc.get("head_dim") or int(tc["hidden_size"]) // heads)
    return int(tc.get("num_key_value_heads") or heads) * head_dim


def check_prefix(weights: AdapterWeights, base: Checkpoint) -> None:
    """Refuse a prefix table that is not ``(tokens, layers * 2 * width)`` for `base`."""
    p = weights.prefix
    want = base.num_layers * 2 * prefix_width(base)
    if p is None or p.shape[1] != want or not 0 < p.shape[0] <= MAX_RANK:
        raise UserError(f"The prefix table has shape {tuple(p.shape) if p is not None else None}; {base.ref} needs "
                        f"(virtual tokens, {want}) (layers x 2 x key/value width): was it trained on this base?")


def prefix_kv(table: "torch.Tensor", layer: int, num_layers: int, heads: int) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Layer `layer`'s keys and values from a prefix table, shaped ``(1, heads, tokens, head size)`` as a
    transformers cache holds them (peft's layout: the layer's keys, then its values, `width` columns each)."""
    tokens, cols = table.shape
    width = cols // (2 * num_layers)
    k, v = (table[:, j * width:(j + 1) * width].reshape(1, tokens, heads, width // heads).transpose(1, 2)
            for j in (2 * layer, 2 * layer + 1))
    return k, v


def prefix_of(ck: Checkpoint) -> "torch.Tensor | None":
    """A prefix-tuning expert's prefix table (None for other experts)."""
    if ck.adapter_kind != "prefix" or not ck.adapter:
        return None
    return read_adapter(ck.adapter).weights().prefix
