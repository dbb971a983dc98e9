"""The one safetensors reader and writer, on its own: layouts, byte ranges, and every way a file can be bad."""

from __future__ import annotations

import os
import json
import re
import struct
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from layerswap import UserError
from layerswap.models.tensorfile import (Files, ShardWriter, encode_header, pread_into, raw_header, read_header,
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
    """Every other module reads and writes weights through layerswap.models.tensorfile."""
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

    from layerswap.models.tensorfile import ALIGN, Files

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


# ---- hostile headers: refused here exactly where safetensors' own reader refuses them --------------------------

def _entry(start: int, end: int, dtype: str = "F32", shape: list | None = None) -> dict:
    return {"dtype": dtype, "shape": [2] if shape is None else shape, "data_offsets": [start, end]}


def _file(header: dict | bytes, data: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _safetensors_opens(path) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            list(f.keys())
        return True
    except Exception:  # noqa: BLE001 - safetensors raises its own SafetensorError (and others for odd input)
        return False


A8 = b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]'
HOSTILE = {  # name -> (file bytes, what the refusal says)
    "overlap": (_file({"a": _entry(0, 8), "b": _entry(0, 8)}, bytes(8)), "may neither overlap nor leave gaps"),
    "overlap-in-the-middle": (_file({"a": _entry(0, 16, shape=[4]), "b": _entry(8, 16), "c": _entry(16, 24)},
                                    bytes(24)), "may neither overlap nor leave gaps"),
    "gap": (_file({"a": _entry(0, 8), "b": _entry(12, 20)}, bytes(20)), "may neither overlap nor leave gaps"),
    "not-from-0": (_file({"a": _entry(4, 12)}, bytes(12)), "may neither overlap nor leave gaps"),
    "end-before-start": (_file({"a": _entry(8, 0)}, bytes(8)), "may neither overlap nor leave gaps"),
    "trailing-bytes": (_file({"a": _entry(0, 8)}, bytes(12)), "4 bytes follow the last tensor"),
    "truncated": (_file({"a": _entry(0, 8)}, bytes(6)), "probably truncated"),
    "size-mismatch": (_file({"a": _entry(0, 12)}, bytes(12)), "needs 8"),
    "shape-overflows": (_file({"a": _entry(0, 0, shape=[2**40, 2**40, 0])}, b""), "more than 2^64 bits"),
    "unknown-dtype": (_file({"a": _entry(0, 8, dtype="F33")}, bytes(8)), "unknown dtype 'F33'"),
    "dtype-not-a-string": (_file({"a": _entry(0, 8, dtype=4)}, bytes(8)), "entry 'a' is not"),
    "negative-size": (_file({"a": _entry(0, 8, shape=[-2])}, bytes(8)), "entry 'a' is not"),
    "float-size": (_file({"a": _entry(0, 8, shape=[2.0])}, bytes(8)), "entry 'a' is not"),
    "bool-size": (_file({"a": _entry(0, 4, shape=[True])}, bytes(4)), "entry 'a' is not"),
    "minus-zero-offset": (_file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[-0,8]}}', bytes(8)),
                          "entry 'a' is not"),
    "offset-past-2^64": (_file({"a": _entry(0, 2**64)}, bytes(8)), "entry 'a' is not"),
    "three-offsets": (_file({"a": {**_entry(0, 8), "data_offsets": [0, 8, 8]}}, bytes(8)), "entry 'a' is not"),
    "no-shape": (_file({"a": {"dtype": "F32", "data_offsets": [0, 8]}}, bytes(8)), "entry 'a' is not"),
    "entry-not-an-object": (_file({"a": [0, 8]}, bytes(8)), "entry 'a' is not"),
    "a-field-twice": (_file(b'{"a":{"dtype":"F32",' + A8[5:] + b"}}", bytes(8)), "entry 'a' is not"),
    "metadata-not-strings": (_file({"__metadata__": {"k": 1}, "a": _entry(0, 8)}, bytes(8)), "__metadata__"),
    "metadata-a-list": (_file({"__metadata__": [], "a": _entry(0, 8)}, bytes(8)), "__metadata__"),
    "metadata-twice": (_file(b'{"__metadata__":{},"__metadata__":{},' + A8 + b"}}", bytes(8)), "__metadata__"),
    "header-a-list": (_file([_entry(0, 8)], bytes(8)), "not a JSON object"),
    "nan": (_file(b"{" + A8 + b',"x":NaN}}', bytes(8)), "not JSON"),
    "lone-surrogate": (_file(b'{"\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8)), "not JSON"),
    "not-utf-8": (_file(b'{"\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8)), "not JSON"),
    "utf-16": (_file(json.dumps({"a": _entry(0, 8)}).encode("utf-16"), bytes(8)), "not JSON"),
    "nul-padding": (_file(b"{" + A8 + b"}}\0\0", bytes(8)), "not JSON"),
    "header-too-long": (struct.pack("<Q", 100_000_001) + b"{}", "header length 100000001 does not fit"),
    "empty-header": (struct.pack("<Q", 0), "header length 0"),
}
ACCEPTED = {  # what safetensors reads, read here too
    "offsets-out-of-name-order": _file({"b": _entry(8, 16), "a": _entry(0, 8)}, bytes(16)),
    "empty-tensors-share-an-offset": _file({"e": _entry(0, 0, shape=[0]), "f": _entry(0, 0, shape=[3, 0]),
                                            "a": _entry(0, 8)}, bytes(8)),
    "no-tensors": _file({}, b""),
    "null-metadata": _file({"__metadata__": None, "a": _entry(0, 8)}, bytes(8)),
    "unknown-fields": _file({"a": {**_entry(0, 8), "x": [-1, {"dtype": 1, "dtype": 2}]}}, bytes(8)),
    "a-name-twice-the-last-counts": _file(b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},' + A8 + b"}}",
                                          bytes(8)),
    "escaped-pair": _file(b'{"\\ud83d\\ude00":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8)),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_header_is_refused_here_as_by_safetensors(tmp_path, name):
    """Each file is refused by `safetensors.safe_open` and by `read_header`, with one line naming the file and
    what to do (the old reader opened the overlapping, gapped, trailing and duplicate-field ones)."""
    blob, msg = HOSTILE[name]
    f = tmp_path / f"{name}.safetensors"
    f.write_bytes(blob)
    assert not _safetensors_opens(f)
    with pytest.raises(UserError, match=re.escape(msg)) as e:
        read_header(f)
    text = str(e.value)
    assert "\n" not in text and str(f) in text and text.endswith("re-download or re-export it.")


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_what_safetensors_reads_is_read_here(tmp_path, name):
    f = tmp_path / f"{name}.safetensors"
    f.write_bytes(ACCEPTED[name])
    assert _safetensors_opens(f)
    entries = read_header(f)
    with safe_open(str(f), "pt") as st:
        assert sorted(entries) == sorted(st.keys())
        for n, e in entries.items():
            assert list(e.shape) == list(st.get_slice(n).get_shape())


def test_a_dtype_safetensors_knows_and_layerswap_does_not_read_says_so(tmp_path):
    """The one deliberate difference: U16 is valid safetensors, which layerswap cannot merge; the refusal says so."""
    f = tmp_path / "u16.safetensors"
    f.write_bytes(_file({"a": _entry(0, 4, dtype="U16")}, bytes(4)))
    assert _safetensors_opens(f)
    with pytest.raises(UserError, match="dtype U16, which layerswap does not read"):
        read_header(f)


def test_shipped_weights_and_the_benchmark_writer_are_valid(tmp_path):
    """Every shipped safetensors file, and a shard as the benchmark trio writes it, passes the full check."""
    shipped = sorted(REPO.glob("assets/**/*.safetensors"))
    assert len(shipped) > 20
    for f in shipped:
        assert read_header(f) and _safetensors_opens(f), f
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_common import _header

    group = [("a.weight", (3, 4)), ("b.weight", (5,)), ("c.bias", (0,))]
    f = tmp_path / "bench.safetensors"
    f.write_bytes(_header(group) + bytes(2 * (12 + 5)))
    assert [(n, e.shape) for n, e in read_header(f).items()] == group and _safetensors_opens(f)
