"""What the demo organism's build measures before any merge: sentence retrieval per layer, the accuracy gates on
the dev set and the cue-swap probes, and each expert's change profile (layerswap's analysis).

Used by scripts/build_demo_experts.py and scripts/build_demo2.py (through it).
"""

from __future__ import annotations

import copy
import os

import torch


def retrieval(model, tok, pairs) -> list[float]:
    """EN->Kovani sentence retrieval top-1 per layer (mean-pooled hidden states, centred per language)."""
    def reps(sents):
        out = None
        with torch.no_grad():
            for s in sents:
                hs = model(input_ids=torch.tensor([tok(s)["input_ids"]]), output_hidden_states=True).hidden_states
                v = [h[0, 1:].mean(0) for h in hs]
                out = [[] for _ in v] if out is None else out
                for k, x in enumerate(v):
                    out[k].append(x)
        return [torch.stack(r) for r in out]
    acc = []
    for E, X in zip(reps([a for a, _ in pairs]), reps([b for _, b in pairs])):
        E, X = E - E.mean(0), X - X.mean(0)
        sim = (E / E.norm(dim=1, keepdim=True)) @ (X / X.norm(dim=1, keepdim=True)).T
        acc.append(round((sim.argmax(1) == torch.arange(len(pairs))).float().mean().item(), 3))
    return acc


def gates(models: dict, tok, out: str, n: int) -> dict:
    """Flexible accuracy of each model on the first `n` dev problems (en, xx) and the cue-swap probes."""
    from layerswap.engines.transformers_engine import TransformersEngine
    from layerswap.evaluation.run import EvalConfig, evaluate

    tok = copy.deepcopy(tok)
    tok.padding_side = "left"  # as layerswap's load_tokenizer does
    engines = {k: TransformersEngine(m, tok, batch_size=64) for k, m in models.items()}
    res = {}
    for src, langs in ((os.path.join(out, "mgsm", "dev"), ["en", "xx"]), (os.path.join(out, "mgsm", "probe"),
                                                                          ["xe", "ex"])):
        rep = evaluate(engines, EvalConfig(langs=langs, limit=n, source=src, max_new_tokens=40))
        for k in models:
            for lang in langs:
                res.setdefault(k, {})[lang] = round(rep.accuracy(k, lang), 4)
    return res


def change_profiles(out: str, pair: str = "") -> dict:
    """Relative change ||expert - base|| / ||base|| per layer and per non-layer tensor (layerswap's analysis)."""
    from layerswap import Checkpoint
    from layerswap.analysis import analyze

    base = Checkpoint.open(os.path.join(out, "base"))
    m, la = (Checkpoint.open(os.path.join(out, pair, r)) for r in ("math", "lang"))
    an = analyze(base, m, la, cache=False)
    rows = {r["tensor"]: r for r in an.non_layer_rows()}
    names = {"emb": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}
    return {role: {"layers": [round(float(x), 4) for x in an.layer_profile(role)],
                   **{k: round(float(rows[t][f"relative_{role}"]), 4) for k, t in names.items()}}
            for role in ("math", "lang")}
