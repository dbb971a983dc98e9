"""Merge methods: small pure tensor functions, and a registry of the methods built from them.

Every function takes float tensors of one shape and returns the merged tensor in float32; the
caller casts to the checkpoint dtype. Methods with a base model work on task vectors
``tau_i = theta_i - theta_base``.

- linear (soup, and layer swapping's blends): ``sum_i w_i * t_i``, accumulated as mergekit's
  ``linear`` kernel does (zeros, then one fused multiply-add per input, in input order), so
  layerswap and mergekit produce bit-identical tensors.
- task arithmetic (Ilharco et al. 2023): ``base + lam * sum_i w_i * tau_i``.
- TIES (Yadav et al. 2023): trim each tau_i to its top-`density` entries by magnitude, elect the
  sign of ``sum_i w_i * trimmed_i`` per entry, average the weighted entries that agree with it
  (the "disjoint mean": divided by how many agree, as peft's ``disjoint_merge``), add
  ``lam`` times that to the base.
- DARE (Yu et al. 2024): drop each entry of tau_i with probability `drop_rate`, rescale the
  survivors by ``1/(1-drop_rate)``, then combine linearly (``dare_linear``) or by TIES's sign
  election and disjoint mean without trimming (``dare_ties``). Masks are seeded per tensor and
  per expert, so results do not depend on the order tensors are processed or the device.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Callable, Sequence

from layerswap.core.bounds import UNIT, Range
from layerswap.core.errors import UserError

if TYPE_CHECKING:  # torch is imported by the functions, so the registry and configs load without it
    import torch
    from torch import Tensor


# ---- pure tensor functions ------------------------------------------------------------------

def linear(tensors: Sequence[Tensor], weights: Sequence[float], out: Tensor | None = None,
           scratch: Tensor | None = None) -> Tensor:
    """``sum_i weights[i] * tensors[i]`` in float32 (no normalisation).

    Bit-identical to mergekit's ``linear`` kernel, which starts from zeros and adds one fused
    multiply-add per input: the first product is exact-rounded either way, and ``+ 0.0`` turns a
    ``-0.0`` product into ``+0.0`` as adding it to a zero accumulator does. Inputs are widened to
    float32 first (exact), which is faster than mixed-dtype kernels. `out` and `scratch` (float32,
    the inputs' size and device) make it allocate nothing: the same operations, in place.
    """
    import torch

    dev = tensors[0].device

    def widened(t: Tensor) -> Tensor:
        return scratch.copy_(t) if scratch is not None else t.to(device=dev, dtype=torch.float32)

    w0 = torch.tensor(weights[0], dtype=torch.float32, device=dev)
    out = torch.mul(widened(tensors[0]), w0, out=out) if out is not None else widened(tensors[0]) * w0
    out.add_(0.0)
    for t, w in zip(tensors[1:], weights[1:]):
        out.addcmul_(widened(t), torch.tensor([w], dtype=torch.float32, device=dev))
    return out


def task_arithmetic(base: Tensor, tensors: Sequence[Tensor], weights: Sequence[float], lam: float = 1.0) -> Tensor:
    """``base + lam * sum_i w_i (t_i - base)``."""
    import torch

    b = base.to(torch.float32)
    delta = sum(w * (t.to(torch.float32) - b) for t, w in zip(tensors, weights))
    return b + lam * delta


def magnitude_prune(tau: Tensor, density: float) -> Tensor:
    """Keep the ``ceil(density * n)`` largest-magnitude entries of `tau`, zero the rest.

    Entries tied with the threshold are all kept.
    """
    import torch

    if density >= 1.0:
        return tau
    n = tau.numel()
    k = int(-(-density * n // 1))  # ceil
    if k <= 0:
        return torch.zeros_like(tau)
    mag = tau.abs().reshape(-1)
    threshold = torch.kthvalue(mag.cpu() if mag.device.type == "mps" else mag, n - k + 1).values
    return tau * (tau.abs() >= threshold)


def random_drop(tau: Tensor, drop_rate: float, generator: torch.Generator, rescale: bool = True) -> Tensor:
    """DARE: zero each entry with probability `drop_rate`; rescale survivors by ``1/(1-drop_rate)``."""
    import torch

    if drop_rate <= 0.0:
        return tau
    keep = torch.rand(tau.shape, generator=generator, dtype=torch.float32) >= drop_rate
    out = tau * keep.to(tau.device)
    return out / (1.0 - drop_rate) if rescale else out


def elect_sign(weighted: Sequence[Tensor]) -> Tensor:
    """Per-entry sign of the summed (weighted, trimmed) task vectors ("total" rule); 0 counts as +."""
    import torch

    total = torch.stack(list(weighted)).sum(dim=0)
    return torch.where(total >= 0, 1.0, -1.0).to(total.dtype)


def disjoint_mean(weighted: Sequence[Tensor], sign: Tensor) -> Tensor:
    """Mean of the non-zero entries whose sign agrees with `sign` (0 where none agree)."""
    import torch

    stacked = torch.stack(list(weighted))
    agree = (torch.sign(stacked) == sign) & (stacked != 0)
    count = agree.sum(dim=0).clamp(min=1)
    return (stacked * agree).sum(dim=0) / count


def ties(base: Tensor, tensors: Sequence[Tensor], weights: Sequence[float], density: float = 0.2,
         lam: float = 1.0) -> Tensor:
    import torch

    b = base.to(torch.float32)
    trimmed = [w * magnitude_prune(t.to(torch.float32) - b, density) for t, w in zip(tensors, weights)]
    return b + lam * disjoint_mean(trimmed, elect_sign(trimmed))


def dare(base: Tensor, tensors: Sequence[Tensor], weights: Sequence[float], drop_rate: float,
         generators: Sequence[torch.Generator], combine: str = "linear", lam: float = 1.0,
         rescale: bool = True) -> Tensor:
    import torch

    b = base.to(torch.float32)
    dropped = [w * random_drop(t.to(torch.float32) - b, drop_rate, g, rescale)
               for t, w, g in zip(tensors, weights, generators)]
    if combine == "linear":
        return b + lam * torch.stack(dropped).sum(dim=0)
    if combine == "ties":
        return b + lam * disjoint_mean(dropped, elect_sign(dropped))
    raise UserError(f"DARE combines with 'linear' or 'ties', not {combine!r}.")


def tensor_generator(seed: int, name: str, index: int) -> torch.Generator:
    """A CPU generator seeded from (seed, tensor name, expert index): order- and device-independent."""
    import torch

    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) * 31 + index) % 2**63)


# ---- configuration and registry -------------------------------------------------------------

# the range of each numeric parameter (expert_weights: of each of the two); the seed's is SEED_LIMIT's
PARAM_RANGES = {"weight": UNIT, "lam": Range(-1000.0, 1000.0), "density": Range(0.0, 1.0, lo_open=True),
                "drop_rate": Range(0.0, 1.0, hi_open=True), "expert_weights": Range(-1000.0, 1000.0)}

@dataclass(frozen=True)
class MethodConfig:
    """Which merge method, with its parameters. Only the parameters a method uses matter to it.

    weight          soup: the language expert's share (the math expert gets 1 - weight)
    expert_weights  task-vector methods: (math, language) weights w_i
    lam             task-vector methods: scale of the merged task vector (lambda)
    density         TIES: fraction of each task vector kept
    drop_rate       DARE: probability of dropping an entry
    seed            DARE: random seed
    """

    name: str = "layer_swap"
    weight: float = 0.5
    expert_weights: tuple[float, float] = (1.0, 1.0)
    lam: float = 1.0
    density: float = 0.2
    drop_rate: float = 0.9
    seed: int = 0

    @property
    def spec(self) -> "MethodSpec":
        if self.name not in METHODS:
            raise UserError(f"Unknown merge method {self.name!r}; choose one of: {', '.join(METHODS)}.")
        return METHODS[self.name]

    def validate(self) -> None:
        spec = self.spec
        if len(self.expert_weights) != 2:
            raise UserError("expert_weights takes two numbers: math, language.")
        for key, bound in PARAM_RANGES.items():
            if key in spec.params:
                for x in self.expert_weights if key == "expert_weights" else (getattr(self, key),):
                    bound.check(x, key)

    def to_dict(self) -> dict:
        spec = self.spec
        d = asdict(self)
        return {"name": self.name, **{k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()
                                      if k in spec.params}}

    @classmethod
    def from_dict(cls, d: dict) -> "MethodConfig":
        names = {f.name for f in fields(cls)}
        kw = {k: (tuple(v) if k == "expert_weights" else v) for k, v in d.items() if k in names}
        return cls(**kw)

    def describe(self) -> str:
        spec = self.spec
        ps = ", ".join(f"{k}={v}" for k, v in self.to_dict().items() if k != "name")
        return f"{spec.title}" + (f" ({ps})" if ps else "")


# A tensor function gets (config, tensor name, base or None, [math, lang]) and returns float32.
TensorFn = Callable[[MethodConfig, str, "Tensor | None", "Sequence[Tensor]"], "Tensor"]


@dataclass(frozen=True)
class MethodSpec:
    name: str
    title: str
    needs_base: bool
    uses_plan: bool  # per-layer weights come from a Plan (layer swapping)
    params: tuple[str, ...]
    description: str
    fn: TensorFn | None = field(default=None, repr=False)
    chunkable: bool = True  # elementwise and stateless: a tensor may be merged slice by slice


def _soup(c: MethodConfig, name: str, base, ts):
    return linear(ts, [1.0 - c.weight, c.weight])


def _ta(c: MethodConfig, name: str, base, ts):
    return task_arithmetic(base, ts, c.expert_weights, c.lam)


def _ties(c: MethodConfig, name: str, base, ts):
    return ties(base, ts, c.expert_weights, c.density, c.lam)


def _dare(combine: str) -> TensorFn:
    def fn(c: MethodConfig, name: str, base, ts):
        gens = [tensor_generator(c.seed, name, i) for i in range(len(ts))]
        return dare(base, ts, c.expert_weights, c.drop_rate, gens, combine, c.lam)

    return fn


METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    if spec.name in METHODS:
        raise ValueError(f"merge method {spec.name!r} is already registered")
    METHODS[spec.name] = spec
    return spec


register(MethodSpec("layer_swap", "Layer swapping", False, True, (),
                    "Bottom b / top u layers from the language expert, the rest from the math expert, "
                    "transition layers blended (Bandarkar et al. 2025)."))
register(MethodSpec("soup", "Model soup", False, False, ("weight",),
                    "Weighted average of the two experts, every tensor (Wortsman et al. 2022).", _soup))
register(MethodSpec("task_arithmetic", "Task arithmetic", True, False, ("expert_weights", "lam"),
                    "base + lambda * sum of weighted task vectors (Ilharco et al. 2023).", _ta))
register(MethodSpec("ties", "TIES", True, False, ("expert_weights", "lam", "density"),
                    "Trim, elect sign, disjoint mean (Yadav et al. 2023).", _ties, chunkable=False))
register(MethodSpec("dare_linear", "DARE + linear", True, False, ("expert_weights", "lam", "drop_rate", "seed"),
                    "Random drop and rescale, then task arithmetic (Yu et al. 2024).", _dare("linear"),
                    chunkable=False))
register(MethodSpec("dare_ties", "DARE + TIES", True, False, ("expert_weights", "lam", "drop_rate", "seed"),
                    "Random drop and rescale, then sign election and disjoint mean.", _dare("ties"),
                    chunkable=False))


# the short names a list of methods may use (`layerswap eval --methods swap,soup,ta,ties`), by registry name
SHORT_NAMES = {"swap": "layer_swap", "ta": "task_arithmetic", "dare": "dare_linear"}
MAX_METHODS = 8  # methods in one list
FAMILY_METHODS = "swap,soup,ties"  # the merges of a family's table unless asked: the paper's (souping, TIES, swap)


def method_list(text: str) -> list[tuple[str, str]]:
    """A comma list of methods (short names or registry names) -> [(as given, registry name)], each once."""
    if not isinstance(text, str) or len(text) > 200:
        raise UserError("--methods takes a comma list such as swap,soup,ta,ties (at most 200 characters).")
    given = [t.strip() for t in text.split(",") if t.strip()]
    known = {**SHORT_NAMES, **{n: n for n in METHODS}}
    bad = [t for t in given if t not in known]
    if bad or not given:
        offer = [*SHORT_NAMES, *(n for n in METHODS if n not in SHORT_NAMES.values())]
        raise UserError((f"Unknown merge method {bad[0]!r}" if bad else "No merge method given") +
                        f"; choose from {', '.join(offer)} (swap = layer_swap, ta = task_arithmetic, "
                        "dare = dare_linear).")
    if len(given) > MAX_METHODS:
        raise UserError(f"--methods lists {len(given)} methods; give at most {MAX_METHODS}.")
    names = [known[t] for t in given]
    dup = next((t for t, n in zip(given, names) if names.count(n) > 1), None)
    if dup is not None:
        raise UserError(f"--methods names {known[dup]} twice; list each method once.")
    return list(zip(given, names))
