"""Model names, files and definitions. Heavy imports live in the functions that need them."""

from batchrun.models.loader import ModelFiles, ModelNotFoundError, cache_dir, resolve_model

__all__ = ["ModelFiles", "ModelNotFoundError", "cache_dir", "resolve_model"]
