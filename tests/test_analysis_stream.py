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
