"""Native architectures: one file per family, and the registry of model types (native.py)."""
