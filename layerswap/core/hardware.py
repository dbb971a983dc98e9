"""The machine engines are planned for, as data: GPUs (count; total and free memory of each), host RAM, scratch
disk, CPU cores, and whether GPUs are attached only inside ZeroGPU calls.

    hw = current()                       # this machine, or what the settings below make it play
    hw = flavour("a100-large")           # a Hugging Face Spaces flavour, from the Hub's own table
    hw.gpu_free(), hw.ram_available, hw.device

`current()` is the one place a serving decision reads the hardware from, and settings fake it, so that every GPU
decision is tested on the CPU:

- ``LAYERSWAP_HARDWARE=<flavour>`` plays a Spaces flavour (`FLAVOURS`: memory, RAM, disk as the Hub states them);
- ``LAYERSWAP_GPU_MEMORY=<GiB>[,<GiB>…]`` plays GPUs of that much memory each (``0``: none);
- ``LAYERSWAP_AVAILABLE_MEMORY`` (bytes) caps the memory seen as available (GPU and RAM), and
  ``LAYERSWAP_AVAILABLE_DISK`` (bytes) the free disk (`scratch.free_bytes`).

A played GPU (a flavour, ``LAYERSWAP_GPU_MEMORY``) is usable but for `CARD_RESERVE` (what the driver and the CUDA
runtime keep on every card: vLLM reports 79.15 GiB usable on an 80 GiB A100) and what this process's engines hold
(`HELD`, written by the engines as they start and release), so a plan made on it sees running engines as a real
GPU's free memory would. This machine's GPUs are measured (NVML, else ``torch.cuda.mem_get_info``): their free
memory already leaves out the driver's reserve.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass

from layerswap.core.errors import UserError
from layerswap.core.runtime import ram_available, ram_total

GiB = 2**30
GB = 10**9
MiB = 2**20
CARD_RESERVE = 1 * GiB  # per played card: the driver's and the CUDA runtime's own (80 GiB A100: vLLM sees 79.15)


@dataclass(frozen=True)
class GPU:
    total: int  # bytes
    free: int  # bytes, now
    name: str = ""
    bandwidth: float = 1.0e12  # memory bytes/s (decode speed is bound by it)


@dataclass(frozen=True)
class Hardware:
    name: str  # a flavour name, or "this"
    gpus: tuple[GPU, ...]
    ram_total: int
    ram_available: int
    disk_free: int
    cpus: int
    zero_gpu: bool = False  # GPUs attached only inside `spaces.GPU` calls, under a daily quota
    vllm: bool | None = True  # vLLM there for its device (a Space: what requirements.txt installs); None: ask
    # `engines.vllm_status` (this machine)
    label: str = ""  # what the Hub calls it
    price: float | None = None  # USD per hour (the Hub's table), for choosing the cheapest that serves
    note: str = ""
    played: bool = False  # not this machine's own: engines cannot start on it

    @property
    def device(self) -> str:
        return "cuda" if self.gpus else "cpu"

    def gpu_free(self, n: int = 1) -> int:
        """The least free memory of the first `n` GPUs (what an engine spanning them can use)."""
        return min(g.free for g in self.gpus[:max(1, n)]) if self.gpus else 0

    def gpu_total(self) -> int:
        return self.gpus[0].total if self.gpus else 0

    def bandwidth(self) -> float:
        return self.gpus[0].bandwidth if self.gpus else 0.0

    def memory_available(self, device: str, gpus: int = 1) -> int:
        """Free GPU memory (`device` cuda) or available RAM (cpu), in bytes."""
        return self.gpu_free(gpus) if device != "cpu" else self.ram_available


def _gpu(mib: int, name: str, bw: float) -> tuple[GPU, ...]:
    return (played_gpu(mib * MiB, name, bw),)


def played_gpu(total: int, name: str, bw: float = 1.0e12) -> GPU:
    """A card known by its nameplate: usable memory is its total less `CARD_RESERVE`."""
    return GPU(int(total), max(0, int(total) - CARD_RESERVE), name, bw)


# The Hub's hardware table (huggingface/hub-docs docs/hub/spaces-gpus.md and spaces-zerogpu.md, read 2026-08): RAM
# and disk in GB as the Hub states them; GPU memory as torch reports it for that card (a "80 GB" A100 is 81920 MiB,
# a "24 GB" L4 23034 MiB); bandwidth from the cards' data sheets. a100-large is the 80 GB A100 (older Hub docs
# said 40 GB); the H100 flavour was removed in December 2025; ZeroGPU's default `large` size is half an RTX Pro
# 6000 Blackwell (48 GB), its RAM is not documented (played as cpu-upgrade's).
FLAVOURS: dict[str, Hardware] = {h.name: h for h in (
    Hardware("cpu-basic", (), 16 * GB, 16 * GB, 50 * GB, 2, vllm=False, label="CPU Basic", price=0.0),
    Hardware("cpu-upgrade", (), 32 * GB, 32 * GB, 50 * GB, 8, vllm=False, label="CPU Upgrade", price=0.03),
    Hardware("t4-small", _gpu(15360, "Tesla T4", 320e9), 15 * GB, 15 * GB, 50 * GB, 4, label="Nvidia T4 - small",
             price=0.40),
    Hardware("l4x1", _gpu(23034, "NVIDIA L4", 300e9), 30 * GB, 30 * GB, 400 * GB, 8, label="1x Nvidia L4", price=0.80),
    Hardware("a10g-large", _gpu(23028, "NVIDIA A10G", 600e9), 46 * GB, 46 * GB, 200 * GB, 12,
             label="Nvidia A10G - large", price=1.50),
    Hardware("l40sx1", _gpu(46068, "NVIDIA L40S", 864e9), 62 * GB, 62 * GB, 380 * GB, 8, label="1x Nvidia L40S",
             price=1.80),
    Hardware("a100-large", _gpu(81920, "NVIDIA A100 80GB", 2039e9), 142 * GB, 142 * GB, 1000 * GB, 12,
             label="Nvidia A100 - large", price=2.50),
    Hardware("h100", _gpu(81559, "NVIDIA H100 80GB", 2000e9), 250 * GB, 250 * GB, 3000 * GB, 24, label="Nvidia H100",
             note="removed from Spaces in December 2025"),
    Hardware("zero-gpu", _gpu(45776, "half an RTX Pro 6000 Blackwell", 900e9), 32 * GB, 32 * GB, 50 * GB, 8,
             zero_gpu=True, vllm=False, label="ZeroGPU (large)", price=0.0,
             note="GPU only inside each call, 2 min (anonymous) / 5 min (free account) a day"),
)}
# what torch calls a card -> its memory bandwidth (bytes/s), for the seconds a question takes on this machine's GPU
BANDWIDTH = {"T4": 320e9, "L4": 300e9, "A10G": 600e9, "A10": 600e9, "L40S": 864e9, "A100": 2039e9, "H100": 3350e9,
             "H200": 4800e9, "RTX PRO 6000": 1790e9}


class Held:
    """Bytes of GPU memory held by this process's engines, by owner (what a played GPU is not free for)."""

    def __init__(self) -> None:
        self._by: dict[int, int] = {}
        self._lock = threading.Lock()

    def hold(self, owner: object, nbytes: int) -> None:
        with self._lock:
            self._by[id(owner)] = self._by.get(id(owner), 0) + int(nbytes)

    def release(self, owner: object) -> int:
        with self._lock:
            return self._by.pop(id(owner), 0)

    def of(self, owner: object) -> int:
        return self._by.get(id(owner), 0)

    def total(self) -> int:
        return sum(self._by.values())


HELD = Held()


def flavour(name: str) -> Hardware:
    """A Spaces flavour from `FLAVOURS`, or ``this`` (`current()`); refused with the names it knows."""
    name = (name or "").strip().lower()
    if name == "this":
        return current()
    if name not in FLAVOURS:
        raise UserError(f"Unknown hardware {name!r}; use one of: this, {', '.join(FLAVOURS)}.")
    return dataclasses.replace(FLAVOURS[name], played=True)


def detect() -> Hardware:
    """This machine as it is now (no setting applied). On ZeroGPU no CUDA call is made: its main process has no GPU."""
    from layerswap.core.scratch import free_bytes, root

    ram = ram_available() or 0
    zero = os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "true")
    gpus = () if zero else _gpus()
    base = FLAVOURS["zero-gpu"] if zero else None
    return Hardware("this", base.gpus if base else gpus, ram_total() or ram, ram, free_bytes(root()),
                    len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                    zero_gpu=zero, vllm=False if zero else None, label="this machine")


def current() -> Hardware:
    """The hardware every serving decision uses: `detect()`, or what ``LAYERSWAP_HARDWARE`` /
    ``LAYERSWAP_GPU_MEMORY`` / ``LAYERSWAP_AVAILABLE_MEMORY`` make it play (see the module's docstring)."""
    name = os.environ.get("LAYERSWAP_HARDWARE", "").strip()
    hw = flavour(name) if name and name != "this" else detect()
    gpu_mem = os.environ.get("LAYERSWAP_GPU_MEMORY", "").strip()
    if gpu_mem:
        try:
            sizes = [float(x) for x in gpu_mem.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"LAYERSWAP_GPU_MEMORY={gpu_mem!r}: give GiB per GPU, e.g. 80 or 80,80 (0: no GPU).") from None
        gpus = tuple(played_gpu(int(s * GiB), f"a {s:g} GiB GPU") for s in sizes if s > 0)
        hw = dataclasses.replace(hw, gpus=gpus, played=True, vllm=True if hw.vllm is None else hw.vllm)
    if hw.played and hw.gpus:  # a played GPU is free but for what this process's engines hold
        held = HELD.total()
        hw = dataclasses.replace(hw, gpus=tuple(dataclasses.replace(g, free=max(0, g.free - held)) for g in hw.gpus))
    cap = os.environ.get("LAYERSWAP_AVAILABLE_MEMORY")
    if cap:
        c = int(float(cap))
        hw = dataclasses.replace(hw, ram_available=min(hw.ram_available, c),
                                 gpus=tuple(dataclasses.replace(g, free=min(g.free, c)) for g in hw.gpus))
    return hw


def _gpus() -> tuple[GPU, ...]:
    """Each visible GPU's total and free memory: NVML when present (no CUDA context in this process), else torch."""
    try:
        import pynvml

        pynvml.nvmlInit()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            m = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            out.append(GPU(int(m.total), int(m.free), name, _bandwidth(name)))
        if os.environ.get("CUDA_VISIBLE_DEVICES"):  # NVML sees every GPU; keep the visible ones, in order
            vis = [int(x) for x in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if x.strip().isdigit()]
            out = [out[i] for i in vis if i < len(out)]
        return tuple(out)
    except Exception:  # no NVML (or no driver): ask torch
        pass
    try:
        import torch

        if not torch.cuda.is_available():
            return ()
        out = []
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            name = torch.cuda.get_device_name(i)
            out.append(GPU(int(total), int(free), name, _bandwidth(name)))
        return tuple(out)
    except Exception:
        return ()


def _bandwidth(name: str) -> float:
    up = name.upper()
    for key in sorted(BANDWIDTH, key=len, reverse=True):
        if key in up:
            return BANDWIDTH[key]
    return 1.0e12



def _nvidia_smi(*args: str) -> str:
    """`nvidia-smi`'s output ("" when there is none, or it fails)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return ""
    try:
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def startup_report() -> list[str]:
    """What the app logs at start about the GPU: the cards `nvidia-smi` lists, the driver and the CUDA version it
    supports, the CUDA torch was built for; and a warning when the machine has an NVIDIA GPU that torch does not see
    (an old driver, a CPU build of torch), instead of quietly running on the CPU."""
    listed = [x.strip() for x in _nvidia_smi("-L").splitlines() if x.strip().startswith("GPU ")]
    try:
        import torch

        torch_cuda, seen = torch.version.cuda, torch.cuda.is_available()
        torch_v = torch.__version__
    except Exception:  # no torch: nothing runs on a GPU either
        torch_cuda, seen, torch_v = None, False, "not installed"
    if not listed:
        return [f"GPU: none listed by nvidia-smi; torch {torch_v} ({'CUDA ' + torch_cuda if torch_cuda else 'CPU build'})"]
    head = _nvidia_smi()
    driver = re.search(r"Driver Version:\s*(\S+)", head)
    cuda = re.search(r"CUDA Version:\s*(\S+)", head)
    lines = [f"GPU: {'; '.join(listed)}", f"NVIDIA driver {driver.group(1) if driver else 'unknown'}, CUDA "
             f"{cuda.group(1) if cuda else 'unknown'} (the driver's); torch {torch_v} built for "
             f"{'CUDA ' + torch_cuda if torch_cuda else 'the CPU only'}"]
    if not seen:
        why = ("torch is a CPU build: install the CUDA build (python3 scripts/dev.py app does on this machine)"
               if not torch_cuda else f"the driver may be too old for CUDA {torch_cuda}: update the NVIDIA driver")
        lines.append(f"WARNING: this machine has an NVIDIA GPU but torch sees none, so everything runs on the CPU; "
                     f"{why}.")
    return lines
