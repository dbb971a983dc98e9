"""The models layerswap works with, by role: the two experts, their base, and the merge."""

from __future__ import annotations

EXPERTS = ("math", "lang")  # the two fine-tuned experts (analysis panels, task vectors)
ANSWERING = ("math", "lang", "merged")  # the models that answer questions side by side
ROLE_NAMES = {"math": "math expert", "lang": "language expert", "merged": "merged model", "base": "base model"}
