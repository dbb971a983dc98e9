"""safetensors files by hand: the one header reader, the one writer, and byte-range reads.

Hand parsing is deliberate: byte offsets let merges copy tensors file to file in the kernel
(``copy_file_range``), and reading headers, checking models and copying need no torch. Every
other module reads and writes weights through this one:

    entries = read_header(path)                    # name -> Entry (dtype, shape, absolute byte range)
    with Files() as files:
        buf = files.read(path, entry.start, entry.nbytes, what=entry.name)
        delta = files.read_aligned(path, aligned_view, entry.start, entry.nbytes, what=entry.name)  # O_DIRECT-ready
    with ShardWriter(out, [(name, dtype, shape), ...]) as w:
        w.copy_from(src_path, src_start, nbytes, w.offsets[name])   # or w.write_at(offset, bytes)
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from layerswap.core.errors import UserError
from layerswap.core.jsonfile import parse_json

if TYPE_CHECKING:
    import torch

# safetensors dtype code -> (torch dtype name, bytes per element)
DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}
ITEMSIZE = {code: size for code, (_, size) in DTYPES.items()}
# dtypes the safetensors format knows that layerswap does not read (sub-byte floats, unsigned, complex)
FOREIGN_DTYPES = frozenset({"F4", "F6_E2M3", "F6_E3M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
                            "U16", "U32", "U64", "C64"})
MAX_HEADER = 100_000_000  # bytes: safetensors' MAX_HEADER_SIZE
USIZE = 2**64  # safetensors reads shapes and offsets as 64-bit unsigned integers
FIELDS = ("dtype", "shape", "data_offsets")  # a tensor entry's fields (safetensors refuses one given twice)
FIX = "re-download or re-export it"


def torch_dtype(code: str) -> "torch.dtype":
    import torch

    return getattr(torch, DTYPES[code][0])


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: dtype code, shape, and absolute byte offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def raw_header(path: Path) -> bytes:
    """The header's JSON bytes, checked only for a plausible length (used for fingerprints too)."""
    size = path.stat().st_size
    bad = f"{path} is not a valid safetensors file"
    if size < 8:
        raise UserError(f"{bad} (only {size} bytes); {FIX}.")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n == 0 or n > min(size - 8, MAX_HEADER):
            raise UserError(f"{bad} (header length {n} does not fit a {size}-byte file); {FIX}.")
        return f.read(n)


class _Object(dict):
    """A JSON object, and the keys that appeared in it more than once (the last one's value is kept)."""

    twice: frozenset = frozenset()


def _object(pairs: list) -> _Object:
    obj = _Object(pairs)
    if len(obj) < len(pairs):
        keys = [k for k, _ in pairs]
        obj.twice = frozenset(k for k in obj if keys.count(k) > 1)
    return obj


def _integer(text: str) -> int | float:
    return -0.0 if text == "-0" else int(text)  # serde_json reads "-0" as a float, so as no size or offset


def _parse(raw: bytes, bad: str) -> dict:
    """The header as JSON the way safetensors (serde_json) reads it: strict UTF-8, no NaN, no lone surrogate."""
    try:
        header = parse_json(raw.decode("utf-8"), max_bytes=MAX_HEADER, object_pairs_hook=_object,
                            parse_int=_integer)  # nesting bounded and NaN refused before it is parsed
        json.dumps(header, ensure_ascii=False).encode("utf-8")  # a lone surrogate (\ud800) does not encode
    except (UnicodeError, ValueError) as e:
        raise UserError(f"{bad} (header is not JSON: {str(e).splitlines()[0]}); {FIX}.") from None
    if not isinstance(header, dict):
        raise UserError(f"{bad} (header is not a JSON object); {FIX}.")
    meta = header.get("__metadata__")
    if "__metadata__" in header.twice or not (meta is None or isinstance(meta, dict) and all(
            isinstance(v, str) for v in meta.values())):
        raise UserError(f"{bad} (its __metadata__ is not one map of strings); {FIX}.")
    return header


def _usize(v: object) -> bool:
    return type(v) is int and 0 <= v < USIZE


def _nbytes(shape: tuple[int, ...], dtype: str) -> int | None:
    """The bytes a tensor of this shape holds, or None where safetensors' 64-bit count overflows."""
    n = 1
    for s in shape:
        n *= s
        if n >= USIZE:
            return None
    return n * ITEMSIZE[dtype] if n * ITEMSIZE[dtype] * 8 < USIZE else None


def read_header(path: str | os.PathLike) -> dict[str, Entry]:
    """Parse and validate a safetensors header as safetensors itself does (`Metadata::validate`): entries
    well-typed with known dtypes, byte ranges in order of their offsets, contiguous from 0 and covering the
    data exactly, each the size its shape and dtype need.

    Raises UserError naming the file when the header is corrupt or inconsistent with the file.
    """
    path = Path(path)
    raw = raw_header(path)
    bad = f"{path} is not a valid safetensors file"
    header = _parse(raw, bad)
    data_start = 8 + len(raw)
    data_len = path.stat().st_size - data_start
    found = []
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(e, dict) and all(k in e for k in FIELDS) and not e.twice & set(FIELDS)
                and isinstance(e["dtype"], str) and isinstance(e["shape"], list) and all(map(_usize, e["shape"]))
                and isinstance(e["data_offsets"], list) and len(e["data_offsets"]) == 2
                and all(map(_usize, e["data_offsets"]))):
            raise UserError(f"{bad} (entry {name!r} is not {{dtype: name, shape: [sizes], "
                            f"data_offsets: [start, end]}}); {FIX}.")
        if e["dtype"] not in ITEMSIZE and e["dtype"] not in FOREIGN_DTYPES:
            raise UserError(f"{bad} (tensor {name!r} has unknown dtype {e['dtype']!r}); {FIX}.")
        found.append((tuple(e["data_offsets"]), name, e["dtype"], tuple(e["shape"])))
    found.sort(key=lambda f: f[0])  # as safetensors: by (start, end), each starting where the one before ended
    end, entries = 0, {}
    for (b, e), name, dtype, shape in found:
        if b != end or e < b:
            raise UserError(f"{bad} (tensor {name!r} claims bytes {b}..{e} but the tensor before it ends at {end}: "
                            f"tensors may neither overlap nor leave gaps); {FIX}.")
        if dtype in FOREIGN_DTYPES:
            raise UserError(f"{path}: tensor {name!r} has dtype {dtype}, which layerswap does not read "
                            f"(it reads {', '.join(DTYPES)}).")
        need = _nbytes(shape, dtype)
        if need != e - b:
            raise UserError(f"{bad} (tensor {name!r} claims {e - b} bytes but its shape {list(shape)} of {dtype} "
                            f"needs {'more than 2^64 bits' if need is None else need}); {FIX}.")
        end = e
        entries[name] = Entry(name, dtype, shape, data_start + b, data_start + e)
    if end != data_len:
        what = "it is probably truncated" if end > data_len else f"{data_len - end} bytes follow the last tensor"
        raise UserError(f"{bad} (its tensors cover {end} data bytes but the file holds {data_len}: {what}); {FIX}.")
    return {name: entries[name] for name in header if name != "__metadata__"}  # in the header's order


def encode_header(tensors: Sequence[tuple[str, str, Sequence[int]]]) -> tuple[bytes, list[int]]:
    """Header bytes for tensors laid out in the given order, and each tensor's absolute offset."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset, rel = 0, []
    for name, dtype, shape in tensors:
        n = math.prod(shape) * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        rel.append(offset)
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    head = struct.pack("<Q", len(raw)) + raw
    return head, [len(head) + r for r in rel]


def pread_into(fd: int, view: memoryview, offset: int, *, file: str | os.PathLike, what: str) -> None:
    """Fill `view` with the bytes at `offset`, or raise a UserError if the file ends early."""
    got = 0
    while got < len(view):
        k = os.preadv(fd, [view[got:]], offset + got)
        if k <= 0:
            raise UserError(f"{file} ended early while reading {what}: the file is truncated; "
                            "re-download or re-export it.")
        got += k


ALIGN = 4096  # O_DIRECT reads: buffer address, file offset and length in whole blocks of this size


class Files:
    """Read-only descriptors, one per file, opened on first use and shared by every reader.

    ``direct=True`` opens them with ``O_DIRECT`` where the platform and file system allow it (else
    as usual): reads then bypass the page cache, for data that cannot stay cached anyway; use
    `read_aligned` with such descriptors."""

    def __init__(self, direct: bool = False) -> None:
        self.fds: dict[str, int] = {}
        self.direct = direct and hasattr(os, "O_DIRECT")

    def fd(self, path: str | os.PathLike) -> int:
        key = str(path)
        if key not in self.fds:
            # no POSIX_FADV_SEQUENTIAL: with three files read in turn, its doubled readahead window
            # thrashes (measured: 3x the system time of the default on the benchmark trio)
            fd = -1
            if self.direct:
                try:
                    fd = os.open(key, os.O_RDONLY | os.O_DIRECT)
                except OSError:  # a file system without direct I/O (tmpfs, some network mounts)
                    fd = -1
            self.fds[key] = fd if fd >= 0 else os.open(key, os.O_RDONLY)
        return self.fds[key]

    def read_aligned(self, path: str | os.PathLike, view: memoryview, offset: int, nbytes: int, *, what: str) -> int:
        """Read bytes ``offset .. offset+nbytes`` into `view` (at an `ALIGN`-aligned address, at least
        ``nbytes + 2*ALIGN`` long) as whole aligned blocks, so a direct descriptor can serve it; returns
        where the bytes start in `view`. A file system that refuses the direct read is read as usual."""
        delta = offset % ALIGN
        need = delta + nbytes
        length = min(len(view), -(-need // ALIGN) * ALIGN)
        got = 0
        while got < need:
            try:
                k = os.preadv(self.fd(path), [view[got:length]], offset - delta + got)
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                os.close(self.fds.pop(str(path)))  # direct I/O refused here: reopen as usual and go on
                self.fds[str(path)] = os.open(str(path), os.O_RDONLY)
                continue
            if k <= 0:
                raise UserError(f"{path} ended early while reading {what}: the file is truncated; "
                                "re-download or re-export it.")
            got += k
        return delta

    def read(self, path: str | os.PathLike, offset: int, nbytes: int, *, what: str) -> bytearray:
        """`nbytes` fresh bytes from `offset` (nothing mapped: memory is what is read)."""
        buf = bytearray(nbytes)
        pread_into(self.fd(path), memoryview(buf), offset, file=path, what=what)
        return buf

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def __enter__(self) -> "Files":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pwrite_all(fd: int, buf, offset: int) -> None:
    view = memoryview(buf).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


class ShardWriter:
    """One safetensors file whose layout is fixed up front: header first, then tensors written at
    their offsets in any order, from any thread (positional writes), by copy or from memory."""

    def __init__(self, path: str | os.PathLike, tensors: Sequence[tuple[str, str, Sequence[int]]]):
        self.path = Path(path)
        header, offsets = encode_header(tensors)
        self.offsets = {name: off for (name, _, _), off in zip(tensors, offsets)}
        size = len(header) + sum(math.prod(s) * ITEMSIZE[d] for _, d, s in tensors)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(self.fd, header, 0)
            os.ftruncate(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise

    def write_at(self, offset: int, buf) -> None:
        pwrite_all(self.fd, buf, offset)

    def copy_from(self, src: str | os.PathLike, src_offset: int, nbytes: int, offset: int, *, what: str = "") -> None:
        """Copy raw bytes from another file (in the kernel when it can, else read and write)."""
        fd = os.open(src, os.O_RDONLY)
        try:
            remaining = nbytes
            try:
                while remaining:
                    n = os.copy_file_range(fd, self.fd, remaining, src_offset, offset)
                    if n == 0:
                        break
                    src_offset, offset, remaining = src_offset + n, offset + n, remaining - n
            except (AttributeError, OSError):  # old kernels, other platforms: plain reads and writes
                pass
            while remaining:
                chunk = os.pread(fd, min(remaining, 64 * 2**20), src_offset)
                if not chunk:
                    raise UserError(f"{src} ended early while copying {what}: the file is truncated.")
                pwrite_all(self.fd, chunk, offset)
                src_offset, offset, remaining = src_offset + len(chunk), offset + len(chunk), remaining - len(chunk)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_tensors(path: str | os.PathLike) -> dict[str, "torch.Tensor"]:
    """Every tensor of one (small) safetensors file, shaped, in fresh memory (a PEFT adapter's weights)."""
    import torch

    out = {}
    with Files() as files:
        for name, e in read_header(path).items():
            buf = files.read(path, e.start, e.nbytes, what=name)
            t = torch.frombuffer(buf, dtype=torch_dtype(e.dtype)) if buf else torch.empty(0, dtype=torch_dtype(e.dtype))
            out[name] = t.reshape(e.shape)
    return out


def write_tensors(path: str | os.PathLike, tensors: dict[str, "torch.Tensor"]) -> None:
    """Write tensors (in memory) as one safetensors file, in name order."""
    import torch

    codes = {torch_dtype(c): c for c in DTYPES}
    items = sorted(tensors.items())
    with ShardWriter(path, [(n, codes[t.dtype], tuple(t.shape)) for n, t in items]) as w:
        for n, t in items:
            data = t.detach().contiguous().cpu().reshape(-1)
            if data.numel():
                w.write_at(w.offsets[n], data.view(torch.uint8).numpy())


def to_float64(buf: bytes, code: str) -> np.ndarray:
    """Floating-point bytes of dtype `code` as float64 (no torch needed)."""
    if code == "BF16":  # bfloat16 is the top half of a float32
        return (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    kinds = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}
    if code not in kinds:
        raise UserError(f"Cannot compare tensors of dtype {code} numerically.")
    return np.frombuffer(buf, dtype=kinds[code]).astype(np.float64)
