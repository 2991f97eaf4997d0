"""Model names, files and definitions. Heavy imports live in the functions that need them."""

from batchrun.models.weights.loader import ModelFiles, ModelNotFoundError
from batchrun.models.weights.resolve import resolve_model
from batchrun.paths import cache_dir

__all__ = ["ModelFiles", "ModelNotFoundError", "cache_dir", "resolve_model"]
