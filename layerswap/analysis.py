"""Where did each expert change? Per layer x parameter type statistics against the base.

Streams tensors one at a time from the safetensors files (never a whole model in memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .checkpoints import PTYPE_LABELS, Checkpoint, check_compatible, ptype_sort_key
from .errors import UserError

METRICS = {"relative": "relative change ‖θ_expert − θ_base‖ / ‖θ_base‖"}


@dataclass
class DiffResult:
    """One expert vs the base. ``values[r, c]``: metric for parameter type r at layer c."""

    expert: str
    base: str
    metric: str
    num_layers: int
    ptypes: list[str]
    values: np.ndarray
    names: list[list[str | None]]  # tensor name per cell, for hovers
    non_layer: dict[str, float] = field(default_factory=dict)

    @property
    def row_labels(self) -> list[str]:
        return [PTYPE_LABELS.get(p, p) for p in self.ptypes]

    def layer_profile(self) -> np.ndarray:
        """Mean over parameter types, per layer."""
        return np.nanmean(self.values, axis=0)

    def to_rows(self) -> list[dict]:
        rows = []
        for r, p in enumerate(self.ptypes):
            for c in range(self.num_layers):
                if self.names[r][c] is not None:
                    rows.append({"tensor": self.names[r][c], "layer": c, "ptype": p, self.metric: float(self.values[r, c])})
        rows += [{"tensor": n, "layer": None, "ptype": "non-layer", self.metric: v} for n, v in self.non_layer.items()]
        return rows


def relative_change(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 accumulation, without materialising a float64 copy of the tensor."""
    num = den = 0.0
    fa, fb = a.reshape(-1), b.reshape(-1)
    step = 1 << 24
    for i in range(0, fa.numel(), step):
        xa, xb = fa[i:i + step].to(torch.float32), fb[i:i + step].to(torch.float32)
        num += float(torch.sum(torch.square(xa - xb), dtype=torch.float64))
        den += float(torch.sum(torch.square(xb), dtype=torch.float64))
    return (num ** 0.5) / (den ** 0.5) if den > 0 else float("nan")


def diff_vs_base(expert: Checkpoint, base: Checkpoint, *, device: str = "cpu",
                 progress: Callable[[float, str], None] | None = None) -> DiffResult:
    """Relative change of every tensor of `expert` from `base`, arranged layer x parameter type."""
    rep = check_compatible(expert, base)
    if not rep.ok:
        raise UserError(f"Cannot compare {expert.ref} with base {base.ref}: {rep.errors[0].what}: {rep.errors[0].detail}.")
    L = expert.num_layers
    ptypes = sorted({t.ptype for t in expert.tensors.values() if t.layer is not None}, key=ptype_sort_key)
    values = np.full((len(ptypes), L), np.nan)
    names: list[list[str | None]] = [[None] * L for _ in ptypes]
    non_layer: dict[str, float] = {}
    items = list(expert.tensors.values())
    for k, info in enumerate(items):
        v = relative_change(expert.get(info.name, device), base.get(info.name, device))
        if info.layer is None:
            non_layer[info.name] = v
        else:
            r = ptypes.index(info.ptype)
            values[r, info.layer] = v
            names[r][info.layer] = info.name
        if progress:
            progress((k + 1) / len(items), info.name)
    return DiffResult(expert.ref, base.ref, "relative", L, ptypes, values, names, non_layer)
