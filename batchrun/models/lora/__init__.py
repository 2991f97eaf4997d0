"""LoRA adapters on the native model: PEFT folders read and checked (adapter.py), the low-rank
update of the base projections for each row of a step (layers.py), and the adapters resident
at once with on-demand loading and LRU eviction (manager.py)."""

from batchrun.models.lora.adapter import LoraAdapter, LoraError, read_adapter
from batchrun.models.lora.manager import LoraManager

__all__ = ["LoraAdapter", "LoraError", "LoraManager", "read_adapter"]
