"""Checkpoints: find a model (local folder or Hub id), know every tensor from its headers, read lazily.

Nothing here loads a whole model. Shapes and dtypes come from the safetensors headers
(`layerswap.models.tensorfile`), each tensor is mapped to (layer, parameter type) by the architecture
table (`layerswap.models.architectures`), and a tensor's bytes are read with ``pread`` only when asked
for. Also here: the compatibility report (from headers only); the shared-base check is in
`layerswap.models.pairing`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

from layerswap.models.architectures import Architecture, architecture, classify
from layerswap.core.bounds import CONFIG_SIZES, MAX_CONFIG_INT, MAX_EPS, MAX_LAYERS, whole
from layerswap.models.cache import content_fingerprint, content_hash, fingerprint
from layerswap.core.errors import UserError
from layerswap.core.markup import text
from layerswap.core.jsonfile import read_json
from layerswap.models.hub import hub_error, hub_id_of, hub_reachable, looks_like_hub_id
from layerswap.models.presets import ASSETS_PREFIX, assets_path
from layerswap.models.tokenizer_files import TOKENIZER_FILES, check_tokenizer_sizes, text_config
from layerswap.models.tensorfile import ITEMSIZE, Files, pread_into, read_header, to_float64, torch_dtype

if TYPE_CHECKING:
    import torch

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


def resolve(ref: str | os.PathLike) -> Path:
    """A local directory, or a Hub repo id (``owner/name[@revision]``) downloaded to the HF cache.

    Only config, safetensors and tokenizer files are downloaded. ``assets:NAME`` is a model shipped
    with layerswap (`layerswap.models.presets`).
    """
    ref = str(ref).strip()
    if not ref:
        raise UserError("No model given: pass a local directory or a Hugging Face Hub id such as 'meta-llama/Llama-3.1-8B'.")
    if ref.startswith(ASSETS_PREFIX):
        return assets_path(ref)
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{ref} is a file; pass the model's directory (with config.json and *.safetensors).")
        return path.resolve()
    if not looks_like_hub_id(ref) or Path(ref.split("/")[0]).is_dir():
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
        raise UserError(
            f"{ref} is not a local directory, and downloading it from the Hugging Face Hub failed "
            f"({hub_error(e)}). Check the id, and HF_TOKEN for gated models, or pass a local directory."
        ) from None


@dataclass
class Checkpoint:
    """A model on disk: its config, where every tensor lives, and lazy access to them."""

    ref: str
    path: Path
    config: dict
    tensors: dict[str, TensorInfo]
    adapter: str | None = None  # the PEFT adapter this checkpoint was merged from (set by adapters.open_expert)
    adapter_base: str | None = None  # the base that adapter was merged into
    adapter_kind: str | None = None  # its PEFT kind: lora, ia3 or prefix (a prefix is not in the weights)
    _files: Files = field(default_factory=Files, repr=False)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def open(cls, ref: str | os.PathLike) -> "Checkpoint":
        """Open a model folder or Hub id (headers only: no weight is read).

        A PEFT adapter folder is refused here: `layerswap.models.adapters.open_expert` merges it into
        its base first.
        """
        return cls.from_folder(resolve(ref), ref)

    @classmethod
    def from_folder(cls, path: Path, ref: str | os.PathLike) -> "Checkpoint":
        """`open` for a folder already resolved (`ref` is what the user gave, kept for reports)."""
        cfg_path = path / "config.json"
        if is_adapter(path):
            raise UserError(f"{ref} is a PEFT adapter, not a full model: pass it as an expert (it is merged into "
                            "its base first) or merge it yourself with peft's merge_and_unload.")
        if not cfg_path.exists():
            raise UserError(f"{ref} has no config.json: pass a Hugging Face model directory.")
        config = read_json(cfg_path)
        if not isinstance(config, dict) or not isinstance(text_config(config), dict):
            raise UserError(f"{ref}: its config.json is not a JSON object of settings; re-download or re-export it.")
        files = cls._weight_files(path, ref)
        tc = text_config(config)
        if tc.get("num_hidden_layers") is None:
            raise UserError(f"{cfg_path} has no num_hidden_layers: is this a decoder-only transformer?")
        # every per-layer list (plans, strips, heatmaps) is this long, and the planner computes with the sizes:
        # each is bounded before anything is expanded or estimated
        for key, top in (("num_hidden_layers", MAX_LAYERS), *((k, MAX_CONFIG_INT) for k in CONFIG_SIZES)):
            v = tc.get(key)
            if v is not None and not whole(v, top):
                raise UserError(f"{ref}: its config.json's {key} is not a whole number from 1 to {top:,}; "
                                "re-download or re-export the model.")
        eps = tc.get("rms_norm_eps", tc.get("layer_norm_eps"))
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps <= MAX_EPS):
            raise UserError(f"{ref}: its config.json's norm epsilon is not a number in (0, {MAX_EPS:g}] (got "
                            f"{str(eps)[:20]}); re-download or re-export the model.")
        if (path / "generation_config.json").is_file():  # read by the engines: the same strict reader first
            read_json(path / "generation_config.json", where=f"{ref}: its generation_config.json")
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, e in read_header(f).items():
                layer, ptype = classify(name, tc["num_hidden_layers"])
                tensors[name] = TensorInfo(name, e.shape, e.dtype, f, e.start, e.end, layer, ptype)
        if not tensors:
            raise UserError(f"{ref}: the safetensors files hold no tensors.")
        return cls(ref=str(ref), path=path, config=config, tensors=tensors)

    @staticmethod
    def _weight_files(path: Path, ref: str) -> list[Path]:
        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = read_json(index, where=f"{ref}: its model.safetensors.index.json")["weight_map"]
                names = list(weight_map.values())
            except (KeyError, AttributeError, TypeError) as e:
                raise UserError(f"{ref}: its model.safetensors.index.json is malformed ({type(e).__name__}); "
                                "re-download or re-export the model.") from None
            listing = model_listing(path)
            return sorted({model_file(path, n, listing, ref, "its index") for n in names})
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
        return text_config(self.config)

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
    def hub_id(self) -> str | None:
        """``owner/name`` when this model (or adapter) was given as a Hub id, not a local folder; else None."""
        return hub_id_of(self.ref)

    @property
    def revision(self) -> str | None:
        """The Hub commit a Hub-id checkpoint (or adapter) was downloaded at (its snapshot folder), else None."""
        parts = Path(self.adapter or self.path).parts
        if len(parts) >= 2 and parts[-2] == "snapshots" and self.hub_id:
            return parts[-1]
        return None

    @property
    def arch(self) -> Architecture:
        """This model's entry in the architecture table (parameter types, groups, labels)."""
        return architecture(self.model_type)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    @property
    def weight_files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})

    def layer_tensors(self, layer: int) -> list[TensorInfo]:
        return [t for t in self.tensors.values() if t.layer == layer]

    def tokenizer_files(self) -> list[Path]:
        """The tokenizer's files, each a file of the model's own folder (`model_file`); file names that
        tokenizer_config.json gives (``*_file`` keys) are checked by the same rule."""
        listing = model_listing(self.path)
        files = [model_file(self.path, n, listing, self.ref, "its folder") for n in TOKENIZER_FILES if n in listing]
        check_tokenizer_sizes(self.path, self.config, self.ref)
        cfg = self.path / "tokenizer_config.json"
        if "tokenizer_config.json" in listing:
            named = read_json(cfg, where=f"{self.ref}: its tokenizer_config.json")
            for k, v in (named.items() if isinstance(named, dict) else ()):
                if k.endswith("_file") and v is not None:
                    model_file(self.path, v, listing, self.ref, f"tokenizer_config.json's {k[:40]}")
        return files

    def tokenizer_hash(self) -> str | None:
        """Identity of the tokenizer by content (equal across folders holding the same tokenizer)."""
        files = [f for f in self.tokenizer_files() if f.name in ("tokenizer.json", "tokenizer.model", "vocab.json")]
        return content_hash((f.name, f.read_bytes()) for f in files) if files else None

    def fingerprint(self) -> str:
        """Cheap identity of the weights: file names, sizes, mtimes and header bytes."""
        return fingerprint(self.weight_files)

    def content_id(self) -> str:
        """Identity by content (weights, config, tokenizer), the same in every clone and on every machine: what
        results files key their records by, so a fresh checkout reuses them."""
        side = [f for f in [self.path / "config.json", *self.tokenizer_files()] if f.is_file()]
        # a prefix-tuning expert's prefix is not in its weights: its adapter file is part of what it is
        prefix = [("prefix", content_fingerprint([Path(self.adapter) / "adapter_model.safetensors"]).encode())] \
            if self.adapter_kind == "prefix" and self.adapter else []
        return content_hash([("weights", content_fingerprint(self.weight_files).encode()), *prefix,
                             *((f.name, f.read_bytes()) for f in side)])

    # ---- lazy tensor access -------------------------------------------------------------
    def read_bytes(self, name: str, start: int = 0, count: int | None = None) -> bytearray:
        """Raw bytes of elements ``start .. start+count`` of a tensor, read with pread (nothing mapped)."""
        info = self.tensors[name]
        size = ITEMSIZE[info.dtype]
        n = info.numel - start if count is None else count
        return self._files.read(info.file, info.start + start * size, n * size, what=name)

    def read_into(self, name: str, start: int, out: memoryview) -> None:
        """Fill `out` with the raw bytes of a tensor's elements from `start` on (as many as `out` holds)."""
        info = self.tensors[name]
        pread_into(self._files.fd(info.file), out, info.start + start * ITEMSIZE[info.dtype], file=info.file, what=name)

    def read(self, name: str, start: int = 0, count: int | None = None) -> "torch.Tensor":
        """Elements ``start .. start+count`` of a tensor (flattened), read with pread into fresh memory.

        Nothing is memory-mapped, so streaming over a large model keeps resident memory at the
        size of what is being read. Returns the full tensor, shaped, when no range is given.
        """
        import torch

        info = self.tensors[name]
        dtype = torch_dtype(info.dtype)
        buf = self.read_bytes(name, start, count)
        t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        return t.reshape(info.shape) if start == 0 and count is None else t

    def get(self, name: str, device: "str | torch.device" = "cpu") -> "torch.Tensor":
        """One whole tensor, shaped, on `device`."""
        t = self.read(name)
        return t if str(device) == "cpu" else t.to(device)

    def read_float64(self, name: str, start: int = 0, count: int | None = None) -> np.ndarray:
        """Floating-point elements as a float64 NumPy array (no torch needed)."""
        return to_float64(self.read_bytes(name, start, count), self.tensors[name].dtype)

    def close(self) -> None:
        self._files.close()


MAX_LISTING = 10_000  # files of one model folder looked at (a model has tens)


def model_listing(folder: Path) -> frozenset[str]:
    """The model's own files: relative POSIX names of the files under `folder` (links to folders are not
    followed). A Hub snapshot holds only files of the repo's own file list, so this is that list's part here."""
    out: list[str] = []
    for dirpath, _, filenames in os.walk(folder):
        rel = Path(dirpath).relative_to(folder)
        out += [(rel / f).as_posix() for f in filenames]
        if len(out) > MAX_LISTING:
            break
    return frozenset(out[:MAX_LISTING])


def plain_name(name: object) -> bool:
    """A relative file name inside a model's folder: no absolute path, no ``..``, ``.`` or empty part, no
    backslash or NUL, at most 255 characters (what a repo's file list or an index may name)."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and "\\" not in name and "\x00" not in name
            and not any(p in ("", ".", "..") for p in name.split("/")))


def model_file(folder: Path, name: object, listing: frozenset[str], ref: object, where: str) -> Path:
    """`name`, read from one of a model's own files (an index's shard, a tokenizer file), as a path: only a
    plain relative name of a file the model's own `listing` holds (no absolute path, no ``..``, no separator
    the listing lacks). The refusal echoes the name (the model's own text, shortened), never a file's
    content or size, so it is no oracle for files elsewhere."""
    if not plain_name(name) or name not in listing:
        shown = repr(name[:60]) if isinstance(name, str) else f"a {type(name).__name__}"
        raise UserError(f"{ref}: {where} names {shown}, which is not a file of the model's own folder (a name "
                        "there must be a relative file name the model holds); re-download or re-export the model.")
    return folder.joinpath(*name.split("/"))


def is_adapter(path: Path) -> bool:
    """A PEFT adapter folder: adapter_config.json and no full model weights."""
    return ((path / "adapter_config.json").exists() and not (path / "model.safetensors").exists()
            and not (path / "model.safetensors.index.json").exists())


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
        """The report for a page: every name from the models' files (architecture, tensor names) as text."""
        out = [f"**{text(self.summary().splitlines()[0])}**"]
        out += [f"- **{m.severity}** {text(m.what)}: {text(m.detail)}" for m in self.mismatches]
        return "\n".join(out)

    def problem(self) -> str | None:
        """Why the models cannot be merged, in one line (None when they can)."""
        if self.ok:
            return None
        first = self.errors[0]
        more = f" (and {len(self.errors) - 1} more; run `layerswap inspect` for all)" if len(self.errors) > 1 else ""
        return f"The models cannot be merged: {first.what}: {first.detail}{more}."

    def raise_if_bad(self) -> None:
        if not self.ok:
            raise UserError(self.problem())


def check_compatible(math: Checkpoint, lang: Checkpoint, base: Checkpoint | None = None,
                     max_listed: int = 20) -> CompatReport:
    """Compare architecture, layer count, tensor names, shapes and dtypes, from headers only."""
    roles = {"math": math, "lang": lang}
    if base is not None:
        roles["base"] = base
    ref = math
    mism: list[Mismatch] = []
    for role, ck in roles.items():
        if not ck.arch.tested:
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
