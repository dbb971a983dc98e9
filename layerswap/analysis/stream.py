"""Slices of the same tensors from several checkpoints, read with pread one block ahead on a background thread.

The analysis walks base, math expert and language expert tensor by tensor, in slices of
``chunk_elems`` elements. Bytes are read with ``pread`` into a small pool of reusable buffers
(nothing is memory-mapped, so resident memory stays at the pool size however large the model
is), in blocks of about ``read_bytes`` per file (large reads keep three interleaved files
streaming at disk speed), one block ahead of the computation, so disk reads overlap with the
arithmetic. When the bytes to read exceed the memory available (`direct_reads`: an 8B trio is
48 GB), they are read with ``O_DIRECT``: they could not stay cached anyway, and bypassing the page
cache saves the kernel copying them through it and reclaiming it (measured on 15 GB of the 8B trio:
about 1 s of system time against 12-25 s) and leaves other programs' cached files alone.

    with ChunkStream([base, math, lang], names, chunk_elems=1 << 19, device="cpu") as s:
        for c in s:                 # c.name, c.start, c.n, c.tensors (one per checkpoint)
            ...
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

from layerswap.models.checkpoints import Checkpoint
from layerswap.core.errors import UserError
from layerswap.core.runtime import ram_available
from layerswap.models.tensorfile import ALIGN, ITEMSIZE, Files, pread_into, torch_dtype

if TYPE_CHECKING:
    import torch

_STOP = object()
CPU_CHUNK = 1 << 18  # 1 MiB float32 slices: the working set stays in cache
CUDA_CHUNK = 1 << 23


def direct_reads(nbytes: int) -> bool:
    """The one decision: read with O_DIRECT when `nbytes` exceed the memory available (they cannot
    stay cached). ``LAYERSWAP_DIRECT_IO=1`` or ``0`` forces it either way."""
    choice = os.environ.get("LAYERSWAP_DIRECT_IO", "auto")
    if choice not in ("auto", "0", "1"):
        raise UserError(f"LAYERSWAP_DIRECT_IO must be auto, 0 or 1 (got {choice!r}).")
    if not hasattr(os, "O_DIRECT") or choice == "0":
        return False
    avail = ram_available()
    return choice == "1" or (avail is not None and nbytes > avail)


def default_chunk(device: str) -> int:
    """Elements per slice on `device` (cpu or cuda[:N])."""
    return CUDA_CHUNK if str(device).startswith("cuda") else CPU_CHUNK


@dataclass
class Chunk:
    """Elements ``start .. start+n`` (flattened) of tensor `name`, one tensor per checkpoint."""

    index: int  # position of `name` in the stream's name list
    name: str
    start: int
    n: int
    last: bool  # the tensor's final chunk
    tensors: list[torch.Tensor]  # in the checkpoint dtype, on the stream's device
    _slot: int = -1


class ChunkStream:
    """Iterate over `names` in slices, reading every checkpoint's copy of each slice.

    All checkpoints must hold each name with one shape and dtype (checked by the caller with
    `check_compatible`). Memory: ``(prefetch + 1) * len(checkpoints) * chunk_elems`` elements of
    the checkpoint dtype, plus what the consumer allocates.
    """

    def __init__(self, checkpoints: Sequence[Checkpoint], names: Sequence[str], *, chunk_elems: int,
                 device: str = "cpu", prefetch: int = 2, read_bytes: int = 8 << 20):
        import torch

        if chunk_elems <= 0:
            raise ValueError("chunk_elems must be positive")
        self.cks = list(checkpoints)
        self.names = list(names)
        self.chunk_elems = int(chunk_elems)
        self.device = torch.device(device)
        self.bytes_read = 0
        sizes = {ITEMSIZE[ck.tensors[n].dtype] for ck in self.cks for n in self.names} or {1}
        # each read covers a whole number of slices, about read_bytes per file
        self.read_elems = self.chunk_elems * max(1, read_bytes // (self.chunk_elems * max(sizes)))
        slot_bytes = self.read_elems * max(sizes)
        pin = self.device.type == "cuda"
        nslots = prefetch + 1
        total = sum(ck.tensors[n].nbytes for ck in self.cks for n in self.names)
        self.direct = direct_reads(total)
        self._bufs = [[self._buffer(slot_bytes, pin) for _ in self.cks] for _ in range(nslots)]
        self._free: queue.Queue = queue.Queue()
        for i in range(nslots):
            self._free.put(i)
        self._ready: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._files = Files(direct=self.direct)
        self._thread = threading.Thread(target=self._run, name="layerswap-reader", daemon=True)
        self._started = False
        self._held: int | None = None

    def _buffer(self, nbytes: int, pin: bool) -> "torch.Tensor":
        """A read buffer; for direct reads `ALIGN`-aligned, with room for the aligned blocks around the bytes."""
        import torch

        if not self.direct:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        raw = torch.empty(nbytes + 3 * ALIGN, dtype=torch.uint8, pin_memory=pin)
        return raw[-raw.data_ptr() % ALIGN:]

    # ---- producer ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            for index, name in enumerate(self.names):
                infos = [ck.tensors[name] for ck in self.cks]
                numel = infos[0].numel
                start = 0
                while start < numel or (numel == 0 and start == 0):
                    n = min(self.read_elems, numel - start)
                    slot = self._take_slot()
                    if slot is None:
                        return
                    deltas = []
                    for buf, info in zip(self._bufs[slot], infos):
                        size = ITEMSIZE[info.dtype]
                        offset = info.start + start * size
                        if self.direct:
                            d = self._files.read_aligned(info.file, memoryview(buf.numpy()), offset, n * size,
                                                         what=info.name)
                            if d % size:  # a tensor not aligned to its element size in the file: move it
                                v = buf.numpy()
                                v[: n * size] = v[d: d + n * size]
                                d = 0
                            deltas.append(d)
                        else:
                            pread_into(self._files.fd(info.file), memoryview(buf.numpy())[: n * size], offset,
                                       file=info.file, what=info.name)
                            deltas.append(0)
                        self.bytes_read += n * size
                    self._ready.put((index, name, start, n, start + n >= numel, slot, deltas))
                    start += max(n, 1)
            self._ready.put(_STOP)
        except BaseException as e:  # handed to the consumer, raised there
            self._ready.put(e)

    def _take_slot(self) -> int | None:
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    # ---- consumer ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Chunk]:
        if not self._started:
            self._started = True
            self._thread.start()
        while True:
            self.release()
            item = self._ready.get()
            if item is _STOP:
                return
            if isinstance(item, BaseException):
                raise item
            index, name, start, n, last, slot, deltas = item
            self._held = slot
            views = []
            for buf, ck, d in zip(self._bufs[slot], self.cks, deltas):
                dtype, size = torch_dtype(ck.tensors[name].dtype), ITEMSIZE[ck.tensors[name].dtype]
                views.append(buf[d: d + n * size].view(dtype))
            for off in range(0, max(n, 1), self.chunk_elems):
                m = min(self.chunk_elems, n - off)
                tensors = [v[off:off + m] for v in views]
                if self.device.type != "cpu":
                    tensors = [t.to(self.device) for t in tensors]
                yield Chunk(index, name, start + off, m, last and off + m >= n, tensors, slot)

    def release(self) -> None:
        """Give the current chunk's buffers back to the reader (called before the next chunk)."""
        if self._held is not None:
            self._free.put(self._held)
            self._held = None

    def close(self) -> None:
        self._stop.set()
        if self._started:
            self._thread.join(timeout=30)
        self._files.close()

    def __enter__(self) -> "ChunkStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
