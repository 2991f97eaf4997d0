"""LoRA adapters served on the one loaded base model (engine/lora.py, models/lora/)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, field_validator

from batchrun.options.fields import option

# A request's `model` naming these runs on the base model (openai/params.py).
RESERVED_NAMES = ("default",)


class LoraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    SECTION: ClassVar[str] = "model"

    adapters: dict[str, str] = option(
        dict, "A LoRA adapter served beside the base model (repeatable). PATH is a PEFT folder "
        "(adapter_config.json + adapter_model.safetensors), local or an fsspec URL; a request "
        "whose `model` is NAME runs on it.", name="lora", flag="--lora", metavar="NAME=PATH")
    max_loras: int = option(4, "LoRA adapters resident at once (and in one step). The others are "
                            "loaded on demand, the least recently used evicted.", ge=1)
    max_lora_rank: int = option(64, "The highest adapter rank accepted.", ge=1)

    @field_validator("adapters")
    @classmethod
    def _names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if not name or not path:
                raise ValueError(f"{name}={path}: use NAME=PATH")
            if name in RESERVED_NAMES:
                raise ValueError(f"{name}={path}: {name!r} names the base model in requests; "
                                 f"give the adapter another name")
        return value
