"""What the lens reports per layer: decoded top tokens and class masses, cosine and linear CKA.

Pure functions on tensors. `summarize` turns logits (one row per layer) into `LayerLens` rows;
`cosine` compares two mean-pooled states; `linear_cka` compares two batches of them (Kornblith
et al. 2019, linear kernel): ``‖Yᵀ X‖²_F / (‖Xᵀ X‖_F ‖Yᵀ Y‖_F)`` on column-centred X, Y,
computed from the n x n Gram matrices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from layerswap.analysis.lens.classes import CLASSES, TokenClasses

if TYPE_CHECKING:
    import torch

MIN_CKA_BATCH = 3  # with two rows, centred Gram matrices have rank one and CKA is 1 whatever the states


@dataclass
class LayerLens:
    """One layer of one model at one position: decoded top tokens and probability mass by class."""

    layer: int
    top: list[tuple[str, float]]
    top_ids: list[int]
    top_classes: list[str]
    p_target: float
    p_english: float
    p_digits: float
    alignment: float | None = None  # cosine with the English twin (mean-pooled prompt states)
    cka: float | None = None  # linear CKA over the batch of parallel questions

    def to_json(self) -> dict:
        return {"layer": self.layer, "top": [[t, p] for t, p in self.top], "p_target": self.p_target,
                "p_english": self.p_english, "p_digits": self.p_digits, "alignment": self.alignment, "cka": self.cka}


def summarize(logits: "torch.Tensor", classes: TokenClasses, top: int = 5) -> list[LayerLens]:
    """One `LayerLens` per row of `logits` (row i = layer i): top tokens and class masses of the softmax."""
    import torch

    probs = torch.softmax(logits.float(), dim=-1)
    codes = torch.as_tensor(classes.codes[: probs.shape[-1]]).long().to(probs.device)
    masses = torch.zeros(probs.shape[0], len(CLASSES), dtype=torch.float64, device=probs.device)
    masses.index_add_(1, codes, probs.double())
    p, ids = probs.topk(min(top, probs.shape[-1]), dim=-1)
    out = []
    for i in range(probs.shape[0]):
        tids = ids[i].tolist()
        texts = [classes.texts[t] if t < len(classes.texts) else f"<id {t}>" for t in tids]
        m = masses[i].tolist()
        out.append(LayerLens(i, [(t, round(float(q), 6)) for t, q in zip(texts, p[i].tolist())], tids,
                             [classes.of(t) for t in tids], round(m[0], 6), round(m[1], 6), round(m[2], 6)))
    return out


def cosine(a: "torch.Tensor", b: "torch.Tensor") -> float:
    import torch

    a, b = a.double(), b.double()
    den = float(torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b))
    return float(a @ b) / den if den > 0 else float("nan")


def linear_cka(x: "torch.Tensor", y: "torch.Tensor") -> float | None:
    """Linear CKA of two n x d batches (rows paired); None when n < `MIN_CKA_BATCH`."""
    if x.shape[0] < MIN_CKA_BATCH:
        return None
    x = x.double() - x.double().mean(0, keepdim=True)
    y = y.double() - y.double().mean(0, keepdim=True)
    k, m = x @ x.T, y @ y.T
    den = float(k.norm() * m.norm())
    return float((k * m).sum()) / den if den > 0 else None
