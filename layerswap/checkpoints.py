"""Checkpoints: find a model (local folder or Hub id), read its safetensors headers, load tensors lazily.

Nothing here loads a whole model. Shapes and dtypes come from the safetensors headers, and a
tensor is read only when asked for (through a memory-mapped ``safe_open`` handle).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from typing import TYPE_CHECKING

import numpy as np

from .errors import UserError
from .hub import hub_reachable

if TYPE_CHECKING:
    import torch

# safetensors dtype code -> (torch dtype name, bytes per element). torch is imported only when a
# tensor is materialised, so reading headers, checking and copying start without it.
_DTYPE_TABLE = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}
ITEMSIZE = {code: size for code, (_, size) in _DTYPE_TABLE.items()}


def torch_dtype(code: str) -> "torch.dtype":
    import torch

    return getattr(torch, _DTYPE_TABLE[code][0])


def __getattr__(name: str):
    """``DTYPES`` (code -> (torch dtype, itemsize)) and ``TORCH_TO_CODE``, built on first use."""
    if name == "DTYPES":
        return {code: (torch_dtype(code), size) for code, size in ITEMSIZE.items()}
    if name == "TORCH_TO_CODE":
        return {torch_dtype(code): code for code in ITEMSIZE}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template*",
    "*.model",
    "vocab*",
    "merges.txt",
    "adapter_config.json",
]
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# Architectures whose tensor layout this tool understands: `model.layers.N.<module>` blocks
# with embeddings before and final norm + lm_head after.
LLAMA_FAMILY = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "phi3"}

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")

# Display order and short labels for per-layer parameter types.
PTYPE_ORDER = [
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "input_layernorm", "post_attention_layernorm",
]
PTYPE_LABELS = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
}
NON_LAYER_GROUPS = ("embed", "final_norm", "lm_head")


def classify(name: str, num_layers: int) -> tuple[int | None, str]:
    """Map a tensor name to ``(layer index or None, parameter type)``.

    ``model.layers.3.self_attn.q_proj.weight`` -> ``(3, "q_proj")``; biases keep a suffix
    (``q_proj.bias``). Tensors outside the blocks get ``None`` and one of ``embed``,
    ``final_norm``, ``lm_head`` or ``other``.
    """
    m = _LAYER_RE.search(name)
    if m and int(m.group(1)) < num_layers:
        rest = m.group(2)
        for prefix in ("self_attn.", "mlp.", "attention.", "feed_forward."):
            if rest.startswith(prefix):
                rest = rest[len(prefix):]
                break
        if rest.endswith(".weight"):
            rest = rest[: -len(".weight")]
        return int(m.group(1)), rest
    if "embed" in name or name.endswith("wte.weight"):
        return None, "embed"
    if name.startswith("lm_head") or name.endswith("lm_head.weight"):
        return None, "lm_head"
    if "norm" in name:
        return None, "final_norm"
    return None, "other"


def ptype_sort_key(ptype: str) -> tuple[int, str]:
    return (PTYPE_ORDER.index(ptype) if ptype in PTYPE_ORDER else len(PTYPE_ORDER), ptype)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it is, read from a safetensors header."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors code, e.g. "BF16"
    file: Path
    start: int  # absolute byte offsets in `file`
    end: int
    layer: int | None
    ptype: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> "torch.dtype":
        return torch_dtype(self.dtype)


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """Parse and validate a safetensors header; return ``(entries, data_start)``.

    Raises UserError naming the file when the header is corrupt or inconsistent with the file.
    """
    size = path.stat().st_size
    bad = f"{path} is not a valid safetensors file"
    fix = "re-download or re-export it"
    if size < 8:
        raise UserError(f"{bad} (only {size} bytes); {fix}.")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n == 0 or n > min(size - 8, 100 * 2**20):
            raise UserError(f"{bad} (header length {n} does not fit a {size}-byte file); {fix}.")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{bad} (header is not JSON: {e}); {fix}.") from None
    if not isinstance(header, dict):
        raise UserError(f"{bad} (header is not a JSON object); {fix}.")
    data_start = 8 + n
    data_len = size - data_start
    entries = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, end) = e["dtype"], tuple(int(s) for s in e["shape"]), e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{bad} (entry {name!r} is malformed); {fix}.") from None
        if dtype not in ITEMSIZE:
            raise UserError(f"{path}: tensor {name!r} has unsupported dtype {dtype}.")
        expected = math.prod(shape) * ITEMSIZE[dtype]
        if not (0 <= b <= end <= data_len) or end - b != expected:
            raise UserError(
                f"{bad} (tensor {name!r} claims bytes {b}..{end} but the file holds {data_len} data bytes "
                f"and the shape needs {expected}); it is probably truncated: {fix}."
            )
        entries[name] = (dtype, shape, data_start + b, data_start + end)
    return entries, data_start


def _looks_like_hub_id(ref: str) -> bool:
    return bool(_HUB_ID_RE.match(ref)) and not ref.startswith((".", "/", "~"))


def resolve(ref: str | os.PathLike) -> Path:
    """A local directory, or a Hub repo id (``owner/name[@revision]``) downloaded to the HF cache.

    Only config, safetensors and tokenizer files are downloaded.
    """
    ref = str(ref).strip()
    if not ref:
        raise UserError("No model given: pass a local directory or a Hugging Face Hub id such as 'meta-llama/Llama-3.1-8B'.")
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{ref} is a file; pass the model's directory (with config.json and *.safetensors).")
        return path.resolve()
    if not _looks_like_hub_id(ref) or Path(ref.split("/")[0]).is_dir():
        raise UserError(f"{ref}: no such directory. Pass a local model directory or a Hub id like 'owner/name'.")
    from huggingface_hub import snapshot_download

    repo, _, revision = ref.partition("@")
    online = hub_reachable()
    try:
        # offline: only what is already in the local HF cache
        return Path(snapshot_download(repo, revision=revision or None, allow_patterns=HUB_PATTERNS,
                                      local_files_only=not online))
    except Exception as e:  # network, auth, missing repo: all user-facing
        if not online:
            raise UserError(f"{ref} is not a local directory nor in the local Hugging Face cache, and the Hub is "
                            "not reachable from this machine: pass a local model directory.") from None
        first = str(e).splitlines()[0] if str(e) else ""
        raise UserError(
            f"{ref} is not a local directory, and downloading it from the Hugging Face Hub failed "
            f"({type(e).__name__}: {first}). Check the id, and HF_TOKEN for gated models, or pass a local directory."
        ) from None


@dataclass
class Checkpoint:
    """A model on disk: its config, where every tensor lives, and lazy access to them."""

    ref: str
    path: Path
    config: dict
    tensors: dict[str, TensorInfo]
    adapter: str | None = None  # the PEFT adapter this checkpoint was merged from, if any
    _handles: dict = field(default_factory=dict, repr=False)
    _fds: dict = field(default_factory=dict, repr=False)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def open(cls, ref: str | os.PathLike, adapter_base: str | os.PathLike | None = None) -> "Checkpoint":
        """Open a model folder or Hub id. A PEFT (LoRA) adapter is merged into its base first.

        `adapter_base` overrides the adapter's ``base_model_name_or_path``.
        """
        path = resolve(ref)
        cfg_path = path / "config.json"
        if (path / "adapter_config.json").exists() and not (path / "model.safetensors").exists() \
                and not (path / "model.safetensors.index.json").exists():
            from .adapters import merge_adapter

            merged = merge_adapter(path, adapter_base)
            ck = cls.open(merged)
            ck.ref, ck.adapter = str(ref), str(path)
            return ck
        if not cfg_path.exists():
            raise UserError(f"{ref} has no config.json: pass a Hugging Face model directory.")
        try:
            config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{cfg_path} is not valid JSON ({e}).") from None
        files = cls._weight_files(path, ref)
        num_layers = int(_text_config(config).get("num_hidden_layers", 0))
        if num_layers <= 0:
            raise UserError(f"{cfg_path} has no num_hidden_layers: is this a decoder-only transformer?")
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            entries, _ = read_safetensors_header(f)
            for name, (dtype, shape, start, end) in entries.items():
                layer, ptype = classify(name, num_layers)
                tensors[name] = TensorInfo(name, shape, dtype, f, start, end, layer, ptype)
        if not tensors:
            raise UserError(f"{ref}: the safetensors files hold no tensors.")
        return cls(ref=str(ref), path=path, config=config, tensors=tensors)

    @staticmethod
    def _weight_files(path: Path, ref: str) -> list[Path]:
        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise UserError(f"{index} is malformed ({e}); re-download or re-export the model.") from None
            files = sorted({path / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise UserError(f"{ref}: the index names shards that are missing: {', '.join(missing)}.")
            return files
        files = sorted(path.glob("*.safetensors"))
        if files:
            return files
        pickles = sorted(p.name for p in path.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
        if pickles:
            raise UserError(
                f"{ref} only has pickle weights ({', '.join(pickles[:3])}). layerswap refuses pickle checkpoints "
                "because loading them can run arbitrary code. Convert them once in a trusted environment: "
                "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)."
            )
        raise UserError(f"{ref} has no *.safetensors weights.")

    # ---- facts --------------------------------------------------------------------------
    @property
    def text_config(self) -> dict:
        return _text_config(self.config)

    @property
    def num_layers(self) -> int:
        return int(self.text_config["num_hidden_layers"])

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or [self.config.get("model_type", "?")]
        return str(archs[0])

    @property
    def model_type(self) -> str:
        return str(self.text_config.get("model_type", self.config.get("model_type", "?")))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def layer_tensors(self, layer: int) -> list[TensorInfo]:
        return [t for t in self.tensors.values() if t.layer == layer]

    def tokenizer_files(self) -> list[Path]:
        return [self.path / n for n in TOKENIZER_FILES if (self.path / n).exists()]

    def tokenizer_hash(self) -> str | None:
        files = [f for f in self.tokenizer_files() if f.name in ("tokenizer.json", "tokenizer.model", "vocab.json")]
        if not files:
            return None
        h = hashlib.sha256()
        for f in files:
            h.update(f.read_bytes())
        return h.hexdigest()[:16]

    def fingerprint(self) -> str:
        """Cheap identity: file names, sizes, mtimes and header bytes of the weight files."""
        h = hashlib.sha256()
        for f in sorted({t.file for t in self.tensors.values()}):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                h.update(fh.read(n))
        return h.hexdigest()[:20]

    # ---- lazy tensor access -------------------------------------------------------------
    def get(self, name: str, device: "str | torch.device" = "cpu") -> "torch.Tensor":
        """Load one tensor (memory-mapped read) onto `device`."""
        from safetensors import safe_open

        info = self.tensors[name]
        handle = self._handles.get(info.file)
        if handle is None:
            handle = safe_open(str(info.file), framework="pt", device="cpu")
            self._handles[info.file] = handle
        t = handle.get_tensor(name)
        return t if str(device) == "cpu" else t.to(device)

    def iter_tensors(self, names: list[str] | None = None, device: str = "cpu") -> "Iterator[tuple[str, torch.Tensor]]":
        for name in names or list(self.tensors):
            yield name, self.get(name, device)

    def read_bytes(self, name: str, start: int = 0, count: int | None = None) -> bytearray:
        """Raw bytes of elements ``start .. start+count`` of a tensor, read with pread (nothing mapped)."""
        info = self.tensors[name]
        size = ITEMSIZE[info.dtype]
        n = info.numel - start if count is None else count
        fd = self._fds.get(info.file)
        if fd is None:
            fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY)
        buf = bytearray(n * size)
        view, got, offset = memoryview(buf), 0, info.start + start * size
        while got < len(buf):
            k = os.preadv(fd, [view[got:]], offset + got)
            if k <= 0:
                raise UserError(f"{info.file} ended early while reading {name}: the file is truncated.")
            got += k
        return buf

    def read(self, name: str, start: int = 0, count: int | None = None) -> "torch.Tensor":
        """Elements ``start .. start+count`` of a tensor (flattened), read with pread into fresh memory.

        Unlike `get` this maps nothing, so streaming over a large model keeps resident memory at
        the size of what is being read. Returns the full tensor, shaped, when no range is given.
        """
        import torch

        info = self.tensors[name]
        dtype = torch_dtype(info.dtype)
        buf = self.read_bytes(name, start, count)
        t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        return t.reshape(info.shape) if start == 0 and count is None else t

    def read_float64(self, name: str, start: int = 0, count: int | None = None) -> np.ndarray:
        """Floating-point elements as a float64 NumPy array (no torch needed)."""
        return _to_float64(self.read_bytes(name, start, count), self.tensors[name].dtype)

    def close(self) -> None:
        self._handles.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _to_float64(buf: bytes, code: str) -> np.ndarray:
    if code == "BF16":  # bfloat16 is the top half of a float32
        return (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    kinds = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}
    if code not in kinds:
        raise UserError(f"Cannot compare tensors of dtype {code} numerically.")
    return np.frombuffer(buf, dtype=kinds[code]).astype(np.float64)


def _text_config(config: dict) -> dict:
    """Multimodal configs (e.g. Gemma 3) nest the language model's config."""
    return config.get("text_config", config) if "num_hidden_layers" not in config else config


# ---- compatibility ---------------------------------------------------------------------------

@dataclass
class Mismatch:
    severity: str  # "error" or "warning"
    what: str
    detail: str


@dataclass
class CompatReport:
    """Whether checkpoints can be merged tensor by tensor, and every reason they cannot."""

    models: dict[str, str]  # role -> reference
    num_layers: int | None
    architecture: str | None
    n_tensors: int
    mismatches: list[Mismatch]

    @property
    def ok(self) -> bool:
        return not any(m.severity == "error" for m in self.mismatches)

    @property
    def errors(self) -> list[Mismatch]:
        return [m for m in self.mismatches if m.severity == "error"]

    def summary(self) -> str:
        roles = ", ".join(f"{r}={ref}" for r, ref in self.models.items())
        head = (
            f"compatible: {self.architecture}, {self.num_layers} layers, {self.n_tensors} tensors ({roles})"
            if self.ok
            else f"NOT compatible ({len(self.errors)} problem{'s' if len(self.errors) != 1 else ''}; {roles})"
        )
        lines = [head]
        for m in self.mismatches:
            lines.append(f"  {m.severity}: {m.what}: {m.detail}")
        return "\n".join(lines)

    def markdown(self) -> str:
        out = [f"**{self.summary().splitlines()[0]}**"]
        out += [f"- **{m.severity}** {m.what}: {m.detail}" for m in self.mismatches]
        return "\n".join(out)

    def raise_if_bad(self) -> None:
        if not self.ok:
            first = self.errors[0]
            more = f" (and {len(self.errors) - 1} more; run `layerswap inspect` for all)" if len(self.errors) > 1 else ""
            raise UserError(f"The models cannot be merged: {first.what}: {first.detail}{more}.")


def check_compatible(math: Checkpoint, lang: Checkpoint, base: Checkpoint | None = None,
                     max_listed: int = 20) -> CompatReport:
    """Compare architecture, layer count, tensor names, shapes and dtypes, from headers only."""
    roles = {"math": math, "lang": lang}
    if base is not None:
        roles["base"] = base
    ref = math
    mism: list[Mismatch] = []
    for role, ck in roles.items():
        if ck.model_type not in LLAMA_FAMILY:
            mism.append(Mismatch("warning", f"{role} architecture",
                                 f"{ck.architecture} ({ck.model_type}) is not a tested Llama-family model; "
                                 "layers are found by the `layers.N.` pattern"))
    for role, ck in roles.items():
        if ck is ref:
            continue
        if ck.architecture != ref.architecture:
            mism.append(Mismatch("error", "architecture",
                                 f"math expert is {ref.architecture}, {role} is {ck.architecture}"))
        if ck.num_layers != ref.num_layers:
            mism.append(Mismatch("error", "layer count",
                                 f"math expert has {ref.num_layers} layers, {role} has {ck.num_layers}"))
        missing = sorted(set(ref.tensors) - set(ck.tensors))
        extra = sorted(set(ck.tensors) - set(ref.tensors))
        if missing:
            mism.append(Mismatch("error", "tensor names",
                                 f"{len(missing)} tensors of the math expert are missing from {role}: "
                                 + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")))
        if extra:
            mism.append(Mismatch("error", "tensor names",
                                 f"{role} has {len(extra)} tensors the math expert lacks: "
                                 + ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else "")))
        listed = 0
        for name in sorted(set(ref.tensors) & set(ck.tensors)):
            a, b = ref.tensors[name], ck.tensors[name]
            if a.shape != b.shape and listed < max_listed:
                mism.append(Mismatch("error", "shape", f"{name}: math {list(a.shape)} vs {role} {list(b.shape)}"))
                listed += 1
            elif a.dtype != b.dtype and listed < max_listed:
                mism.append(Mismatch("error", "dtype",
                                     f"{name}: math {a.dtype} vs {role} {b.dtype}; convert one "
                                     "checkpoint so both use the same dtype"))
                listed += 1
        if ck.tokenizer_hash() != ref.tokenizer_hash():
            mism.append(Mismatch("warning", "tokenizer",
                                 f"{role}'s tokenizer files differ from the math expert's; the merge uses the math "
                                 "expert's tokenizer"))
    return CompatReport(
        models={r: ck.ref for r, ck in roles.items()},
        num_layers=ref.num_layers,
        architecture=ref.architecture,
        n_tensors=len(ref.tensors),
        mismatches=mism,
    )


# ---- do the experts share the base? ------------------------------------------------------------

BASE_DISTANCE_THRESHOLD = 0.5


def _sample_names(ck: Checkpoint, n_layers: int = 6) -> list[str]:
    """A few 2-D tensors spread over depth (attention and MLP), plus the embeddings."""
    L = ck.num_layers
    layers = sorted({round(i * (L - 1) / max(n_layers - 1, 1)) for i in range(n_layers)})
    names = []
    for layer in layers:
        for t in ck.layer_tensors(layer):
            if len(t.shape) == 2 and t.ptype in ("q_proj", "down_proj"):
                names.append(t.name)
    names += [t.name for t in ck.tensors.values() if t.ptype == "embed" and len(t.shape) == 2]
    return names


def sampled_distance(a: Checkpoint, b: Checkpoint, rows: int = 32) -> float:
    """‖a − b‖ / ‖b‖ over the first `rows` rows of a sample of tensors (reads a few MB at most)."""
    num = den = 0.0
    for name in _sample_names(b):
        info = b.tensors[name]
        n = min(rows, info.shape[0]) * math.prod(info.shape[1:])
        xa, xb = a.read_float64(name, 0, n), b.read_float64(name, 0, n)
        num += float(np.sum((xa - xb) ** 2))
        den += float(np.sum(xb ** 2))
    return (num ** 0.5) / (den ** 0.5) if den else float("nan")


@dataclass
class Pairing:
    """Sampled distances that tell whether two experts were fine-tuned from the same base."""

    distances: dict[str, float]  # "math-base", "lang-base", or "math-lang" when no base is given
    threshold: float

    @property
    def suspicious(self) -> dict[str, float]:
        limit = lambda k: self.threshold * (2 ** 0.5 if k == "math-lang" else 1)  # noqa: E731
        return {k: v for k, v in self.distances.items() if not v <= limit(k)}

    def message(self) -> str:
        d = ", ".join(f"{k} {v:.3f}" for k, v in self.distances.items())
        if not self.suspicious:
            return f"shared base: sampled relative distances {d} (threshold {self.threshold})"
        return (f"the experts may not share a base: sampled relative distances {d} exceed the threshold "
                f"{self.threshold} (light fine-tunes of one base are usually far below it; unrelated models are "
                "near 1.4). Merging models of different bases rarely works; pass --force to run it anyway")


def check_pairing(math: Checkpoint, lang: Checkpoint, base: Checkpoint | None = None,
                  threshold: float = BASE_DISTANCE_THRESHOLD) -> Pairing:
    """Distance of each expert from the base on sampled tensors (or between experts without one)."""
    if base is not None:
        d = {"math-base": sampled_distance(math, base), "lang-base": sampled_distance(lang, base)}
    else:
        d = {"math-lang": sampled_distance(math, lang)}
    return Pairing(d, threshold)
