"""layerswap: layer swapping for zero-shot cross-lingual transfer (Bandarkar et al., ICLR 2025).

Python API at a glance::

    from layerswap import Checkpoint, Plan, Recipe, check_compatible, export_merge
    math, lang = Checkpoint.open("math-expert/"), Checkpoint.open("lang-expert/")
    print(check_compatible(math, lang).summary())
    export_merge(math, lang, Recipe(plan=Plan(b=5, u=2, tb=1, tu=1)), "merged/")
"""

from layerswap.models.architectures import classify
from layerswap.models.checkpoints import Checkpoint, CompatReport, check_compatible
from layerswap.models.family import Family, check_family
from layerswap.core.errors import UserError
from layerswap.merge.merging import blend, export_merge, merge_in_memory
from layerswap.recipe.methods import METHODS, MethodConfig
from layerswap.recipe.plans import Plan, default_plan
from layerswap.recipe.recipes import Recipe
from layerswap.recipe.sources import Sources, TensorSource, tensor_sources, tensor_weights
from layerswap.core.version import __version__

__all__ = [
    "METHODS", "Checkpoint", "CompatReport", "Family", "MethodConfig", "Plan", "Recipe", "Sources", "TensorSource", "UserError",
    "blend", "check_compatible", "check_family", "classify", "default_plan", "export_merge", "merge_in_memory", "tensor_sources",
    "tensor_weights", "__version__",
]
