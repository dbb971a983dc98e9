"""layerswap.analysis.stream: ChunkStream hands over every byte of every checkpoint, slice by slice."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from layerswap import Checkpoint
from layerswap.analysis.stream import ChunkStream


@pytest.mark.parametrize("chunk", [1, 1000, 1 << 20])
def test_chunk_stream_reads_every_byte(trio_bf16, chunk):
    c = {r: Checkpoint.open(trio_bf16[r]) for r in ("base", "lang")}
    names = ["model.embed_tokens.weight", "model.layers.1.input_layernorm.weight"]
    got = {n: [] for n in names}
    with ChunkStream([c["base"], c["lang"]], names, chunk_elems=chunk) as s:
        for ch in s:
            assert ch.n <= chunk
            got[ch.name].append([t.clone() for t in ch.tensors])
            if chunk == 1 and ch.start > 50:
                break
    if chunk == 1:
        return
    for n in names:
        assert got[n][-1] and sum(len(parts[0]) for parts in got[n]) == c["base"].tensors[n].numel
        for j, role in enumerate(("base", "lang")):
            flat = torch.cat([parts[j] for parts in got[n]])
            assert torch.equal(flat, load_file(trio_bf16[role] / "model.safetensors")[n].reshape(-1))


def test_chunk_size_must_be_positive(trio):
    with pytest.raises(ValueError, match="positive"):
        ChunkStream([Checkpoint.open(trio["base"])], ["model.embed_tokens.weight"], chunk_elems=0)


@pytest.mark.parametrize("chunk", [1000, 1 << 20])
def test_direct_reads_hand_over_the_same_bytes(trio_bf16, chunk, monkeypatch):
    """With LAYERSWAP_DIRECT_IO=1 (O_DIRECT, whole aligned blocks) every slice is what buffered reads give."""
    c = [Checkpoint.open(trio_bf16[r]) for r in ("base", "math", "lang")]
    names = sorted(c[0].tensors, key=lambda n: c[0].tensors[n].start)
    got = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("LAYERSWAP_DIRECT_IO", mode)
        with ChunkStream(c, names, chunk_elems=chunk, read_bytes=1 << 16) as s:
            assert s.direct == (mode == "1")
            got[mode] = [(ch.name, ch.start, [t.clone() for t in ch.tensors]) for ch in s]
    assert len(got["0"]) == len(got["1"]) >= len(names)
    for (n0, s0, t0), (n1, s1, t1) in zip(got["0"], got["1"]):
        assert (n0, s0) == (n1, s1) and all(torch.equal(a, b) for a, b in zip(t0, t1))


def test_direct_reads_are_chosen_for_more_than_the_memory(monkeypatch):
    from layerswap.analysis import stream

    monkeypatch.setenv("LAYERSWAP_DIRECT_IO", "auto")
    monkeypatch.setattr(stream, "ram_available", lambda: 10 * 2**30)
    assert stream.direct_reads(48 * 10**9) and not stream.direct_reads(6 * 10**9)
    monkeypatch.setenv("LAYERSWAP_DIRECT_IO", "0")
    assert not stream.direct_reads(48 * 10**9)
    monkeypatch.setenv("LAYERSWAP_DIRECT_IO", "yes")
    with pytest.raises(Exception, match="auto, 0 or 1"):
        stream.direct_reads(1)
