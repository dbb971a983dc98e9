"""The latent-language lens: layer by layer, where each model reads the target language and where it thinks in English.

For a prompt (an MGSM question in a target language, or free text) and each of math expert,
language expert, merged model and base:

- **logit lens**: every layer's state at the last prompt position (and, optionally, at each
  position of the model's greedy answer) decoded through the model's own final norm and lm_head:
  top tokens, and the probability mass on target-language, English and digit tokens
  (`classes` states the rule);
- **cross-lingual alignment**: cosine of the prompt's mean-pooled states with its English twin's,
  and linear CKA over a batch of parallel MGSM questions, per layer.

Models run in memory, or streamed from their safetensors files one block at a time (`forward`).

    from layerswap.analysis.lens import LensConfig, run_lens, lens_grid, lens_curves, write_report
    res = run_lens("math/", "lang/", recipe, base="base/", config=LensConfig("sw", index=3))
    res.write_json("lens.json"); write_report(res, "lens.html")
"""

from layerswap.analysis.lens.classes import CLASSES, TokenClasses, token_classes
from layerswap.analysis.lens.forward import MergedSource, Stack, WeightSource
from layerswap.analysis.lens.inputs import LensConfig
from layerswap.analysis.lens.metrics import LayerLens, cosine, linear_cka
from layerswap.analysis.lens.run import (FORWARD_CHOICES, ROLES, AnswerLens, LensResult, ModelLens, lens_model,
                                         lens_stacks, lens_workbench, run_lens)

_FIGURES = ("lens_curves", "lens_grid", "write_report")


def __getattr__(name: str):
    """The figure builders import plotly: only when asked for (the CLI starts without it)."""
    if name in _FIGURES:
        from layerswap.analysis.lens import figures

        return getattr(figures, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CLASSES", "FORWARD_CHOICES", "ROLES", "AnswerLens", "LayerLens", "LensConfig", "LensResult", "MergedSource",
    "ModelLens", "Stack", "TokenClasses", "WeightSource", "cosine", "lens_curves", "lens_grid", "lens_model",
    "lens_stacks", "lens_workbench", "linear_cka", "run_lens", "token_classes", "write_report",
]
