"""The one safetensors reader and writer, on its own: layouts, byte ranges, and every way a file can be bad."""

from __future__ import annotations

import os
import re
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from layerswap import UserError
from layerswap.tensorfile import (Files, ShardWriter, encode_header, pread_into, raw_header, read_header,
                                  to_float64)
from tests.helpers import REPO

TENSORS = {
    "a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "b.weight": torch.linspace(-2, 2, 10, dtype=torch.bfloat16),
    "c.bias": torch.tensor([1.5, -0.25, 3.0], dtype=torch.float16),
    "empty": torch.zeros(0, dtype=torch.float32),
}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_reader_agrees_with_the_safetensors_library(tmp_path):
    f = tmp_path / "m.safetensors"
    save_file(TENSORS, str(f))
    entries = read_header(f)
    assert set(entries) == set(TENSORS)
    data = f.read_bytes()
    for name, t in TENSORS.items():
        e = entries[name]
        assert e.shape == tuple(t.shape) and e.nbytes == t.numel() * t.element_size()
        assert data[e.start:e.end] == _bytes(t)
    with Files() as files:
        e = entries["a.weight"]
        assert bytes(files.read(f, e.start + 8, 16, what="a.weight")) == _bytes(TENSORS["a.weight"])[8:24]


def test_writer_output_loads_in_the_safetensors_library(tmp_path):
    src = tmp_path / "src.safetensors"
    save_file(TENSORS, str(src))
    e = read_header(src)
    layout = [(n, {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[str(t.dtype).split(".")[1]], tuple(t.shape))
              for n, t in sorted(TENSORS.items(), key=lambda kv: -kv[1].element_size())]
    out = tmp_path / "out.safetensors"
    with ShardWriter(out, layout) as w:
        assert all(off % 8 == 0 for off in list(w.offsets.values())[:1])  # data starts 8-byte aligned
        w.copy_from(src, e["b.weight"].start, e["b.weight"].nbytes, w.offsets["b.weight"], what="b.weight")
        w.write_at(w.offsets["a.weight"], _bytes(TENSORS["a.weight"]))
        half = e["c.bias"].nbytes // 2  # a tensor may arrive in pieces, at its offsets
        w.write_at(w.offsets["c.bias"], _bytes(TENSORS["c.bias"])[:half])
        w.write_at(w.offsets["c.bias"] + half, _bytes(TENSORS["c.bias"])[half:])
    back = load_file(str(out))
    for name, t in TENSORS.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    head, offsets = encode_header(layout)
    assert out.read_bytes()[:len(head)] == head and len(head) % 8 == 0 and offsets[0] == len(head)


@pytest.mark.parametrize("damage, msg", [
    (lambda d: d[:5], "only 5 bytes"),
    (lambda d: struct.pack("<Q", 10**9) + d[8:], "header length 1000000000 does not fit"),
    (lambda d: d[:8] + b"[" + d[9:], "header is not JSON"),
    (lambda d: d[:-7], "probably truncated"),
])
def test_bad_files_are_refused_with_the_fix(tmp_path, damage, msg):
    f = tmp_path / "m.safetensors"
    save_file(TENSORS, str(f))
    f.write_bytes(damage(f.read_bytes()))
    with pytest.raises(UserError, match=re.escape(msg)) as e:
        read_header(f)
    assert str(f) in str(e.value) and ("re-download or re-export" in str(e.value) or "only" in str(e.value))


def test_short_read_names_the_file(tmp_path):
    f = tmp_path / "short.bin"
    f.write_bytes(b"1234")
    with Files() as files, pytest.raises(UserError, match="short.bin ended early while reading x"):
        pread_into(files.fd(f), memoryview(bytearray(8)), 0, file=f, what="x")


def test_to_float64_matches_torch():
    for dtype, code in ((torch.bfloat16, "BF16"), (torch.float16, "F16"), (torch.float32, "F32")):
        t = torch.randn(100, generator=torch.Generator().manual_seed(0)).to(dtype)
        assert np.array_equal(to_float64(_bytes(t), code), t.double().numpy())
    with pytest.raises(UserError, match="I32"):
        to_float64(b"\0" * 4, "I32")


def test_raw_header_is_the_json_bytes(tmp_path):
    f = tmp_path / "m.safetensors"
    save_file(TENSORS, str(f))
    (n,) = struct.unpack("<Q", f.read_bytes()[:8])
    assert raw_header(f) == f.read_bytes()[8:8 + n]


def test_it_is_the_only_safetensors_parser():
    """Every other module reads and writes weights through layerswap.tensorfile."""
    for path in (REPO / "layerswap").rglob("*.py"):
        if path.name == "tensorfile.py":
            continue
        text = path.read_text()
        for needle in ("struct.unpack", "safe_open(", "os.preadv", "os.copy_file_range", "os.pwrite"):
            assert needle not in text, f"{path.relative_to(REPO)} uses {needle}"


def test_aligned_reads_give_the_bytes_asked_for(tmp_path, monkeypatch):
    """Files(direct=True).read_aligned: whole aligned blocks around any range, also at the file's end,
    and plain reads where the file system refuses O_DIRECT."""
    import mmap

    from layerswap.tensorfile import ALIGN, Files

    data = bytes(range(256)) * 200 + b"tail"  # 51204 bytes: the end is not block-aligned
    f = tmp_path / "x.bin"
    f.write_bytes(data)
    buf = mmap.mmap(-1, 3 * ALIGN + 2 * ALIGN + 51204)  # page-aligned
    view = memoryview(buf)
    for direct in (True, False):
        with Files(direct=direct) as files:
            for off, n in ((0, 10), (5, 4091), (4096, 4096), (4095, 2), (51200, 4), (12345, 30000), (0, 51204)):
                d = files.read_aligned(f, view, off, n, what="t")
                assert bytes(view[d:d + n]) == data[off:off + n], (direct, off, n)
            with pytest.raises(UserError, match="truncated"):
                files.read_aligned(f, view, 51200, 100, what="t")
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    with Files(direct=True) as files:
        d = files.read_aligned(f, view, 7, 100, what="t")
        assert bytes(view[d:d + 100]) == data[7:107]
