"""A .gguf file's header and tensor table checked before it is converted or read: a damaged or
lying file (a bad magic or version, counts or strings running past the end, tensors of unknown
types, zero dimensions, or data beyond the file's end) is refused by name instead of failing
deep inside a conversion, or reading past its end."""

from __future__ import annotations

from pathlib import Path

from batchrun.models.errors import ModelFolderError, naming


def check_gguf(path: str | Path) -> None:
    """ModelFolderError naming `path` and what is wrong with it."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    from batchrun.models.weights.gguf_weights import read_header

    path = Path(path)
    with naming(path, "not a readable GGUF file"):
        meta, tensors, start = read_header(path)
    size = path.stat().st_size
    if not tensors:
        raise ModelFolderError(f"{path}: its GGUF header lists no tensors")
    for name, dims, kind, offset in tensors:
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ModelFolderError(f"{path}: tensor {name!r} has unknown GGUF type {kind}") \
                from None
        if not dims or any(d <= 0 for d in dims) or dims[0] % block:
            raise ModelFolderError(f"{path}: tensor {name!r} has dimensions {dims}, which its "
                                   f"type ({block}-element blocks) cannot hold")
        count = 1
        for d in dims:
            count *= d
        end = start + offset + count // block * block_bytes
        if end > size:
            raise ModelFolderError(f"{path}: tensor {name!r} ends at byte {end:,}, past the end "
                                   f"of the file ({size:,} bytes): it is truncated or damaged")
