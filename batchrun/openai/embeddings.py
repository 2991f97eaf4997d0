"""/v1/embeddings: inputs -> pooled engine requests, outputs -> OpenAI's CreateEmbeddingResponse.

    {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...]}],
     "model": ..., "usage": {"prompt_tokens": N, "total_tokens": N}}

`encoding_format: "base64"` gives each vector as the base64 of its little-endian float32
bytes (what the openai client decodes). `dimensions: N` keeps the first N values and
renormalises them to unit length (unless normalisation is off, --no-normalize), the way
Matryoshka-trained models are meant to be truncated.

Pooling defaults come from a sentence-transformers config in the model folder when there is
one (modules.json naming a Pooling module and, optionally, a Normalize module), else `last`
pooling, normalised (vLLM's default for decoder-only models).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from batchrun.engine.outputs import RequestOutput
from batchrun.engine.pooling import PoolingParams, PoolingType

log = logging.getLogger(__name__)

# sentence-transformers' Pooling config keys, in the order it would pick one.
_ST_MODES: tuple[tuple[str, PoolingType], ...] = (("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
             ("pooling_mode_lasttoken", "last"))


def sentence_transformers_pooling(path: str | Path | None
                                  ) -> tuple[PoolingType | None, bool | None]:
    """(pooling, normalize) a sentence-transformers config in the model folder asks for; Nones
    where there is none or it says nothing we support."""
    if path is None:
        return None, None
    folder = Path(path)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None, None
    try:
        modules = json.loads(modules_file.read_text())
        types = [(str(m.get("type", "")), str(m.get("path", ""))) for m in modules]
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("ignoring %s: %s", modules_file, exc)
        return None, None
    normalize = any(t.endswith("Normalize") for t, _ in types)
    pooling: PoolingType | None = None
    for kind, sub in types:
        if not kind.endswith("Pooling"):
            continue
        try:
            cfg = json.loads((folder / sub / "config.json").read_text())
        except (OSError, ValueError) as exc:
            log.warning("ignoring the sentence-transformers pooling config in %s: %s", sub, exc)
            break
        pooling = next((name for key, name in _ST_MODES if cfg.get(key)), None)
        if pooling is None:
            log.warning("the sentence-transformers pooling in %s (%s) is not supported; "
                        "using last-token pooling (set --pooling)", sub,
                        ", ".join(k for k, v in cfg.items() if v is True) or "none")
        break
    return pooling, normalize


def resolve_pooling(pooling: PoolingType | None, normalize: bool | None,
                    path: str | Path | None) -> PoolingParams:
    """The options' choice, else the model's sentence-transformers config, else last, normalised."""
    st_pooling, st_normalize = (None, None) if pooling is not None and normalize is not None \
        else sentence_transformers_pooling(path)
    return PoolingParams(pooling or st_pooling or "last",
                         normalize if normalize is not None else
                         (st_normalize if st_normalize is not None else True))


def truncate(vector: Sequence[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The first `dimensions` values, renormalised to unit length when `normalize`."""
    if dimensions is None or dimensions >= len(vector):
        return list(vector)
    v = list(vector[:dimensions])
    if normalize:
        norm = math.sqrt(sum(x * x for x in v))
        if norm > 0:
            v = [x / norm for x in v]
    return v


def encode_base64(vector: Sequence[float]) -> str:
    """Little-endian float32 bytes, base64: what the openai client decodes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@dataclass
class EmbeddingFormatter:
    model_name: str
    encoding_format: str = "float"
    dimensions: int | None = None
    normalize: bool = True

    def body(self, outputs: Sequence[RequestOutput], created: int | None = None) -> dict[str, Any]:
        data = []
        for i, out in enumerate(outputs):
            vector = truncate(out.embedding or [], self.dimensions, self.normalize)
            data.append({"object": "embedding", "index": i,
                         "embedding": encode_base64(vector) if self.encoding_format == "base64"
                         else vector})
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
