"""A model spec's config without its weights (footprint.py and `batchrun models check` read it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _auto_config(source, trust_remote_code: bool, path: str | Path, **kwargs: Any):
    """transformers' AutoConfig.from_pretrained(path, **kwargs), its sizes checked; what goes
    wrong is a ModelFolderError naming `source`."""
    from transformers import AutoConfig

    from batchrun.models.weights.remote_code import auto_kwargs, refuse_config_code
    from batchrun.models.config.sizes import check_config
    from batchrun.models.errors import naming

    with naming(source, "transformers cannot read its config"):
        config = AutoConfig.from_pretrained(path, **kwargs, **auto_kwargs(trust_remote_code))
    refuse_config_code(config, source, trust_remote_code)
    check_config(config.to_dict(), source)
    return config


def config_for(model: str | None, trust_remote_code: bool = False):
    """The config of `model` (registry name, HF folder, .gguf file, hub id; None = the default
    model) without loading, converting or downloading its weights: config.json of the folder or
    of the GGUF's cached conversion, else the GGUF's metadata, else the hub's config.json;
    hf_config.read_config's plain attributes where it reads the file. ModelFolderError for a
    config out of range (sizes.py) or one that needs the folder's code without
    `trust_remote_code`."""
    from batchrun.models.weights import registry
    from batchrun.models.config.hf_config import read_config
    from batchrun.models.weights.loader import ModelNotFoundError
    from batchrun.models.weights.resolve import HUB_ID, from_folder

    spec = (model or "").strip()
    if spec in ("", "default"):
        spec = registry.DEFAULT_MODEL
    entry = registry.lookup(spec)
    if entry is not None:
        gguf = registry.find_gguf(entry)
        if gguf is None:
            raise ModelNotFoundError(registry.missing_message(entry))
        return _gguf_config(gguf, trust_remote_code)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            from_folder(path, spec)  # raises the loader's explanation
        return read_config(path, trust_remote_code)  # a *.bin folder is not converted for this
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_config(path, trust_remote_code)
    if not path.exists() and HUB_ID.match(spec):
        try:
            return _auto_config(spec, trust_remote_code, spec)
        except Exception as exc:  # offline, unknown or gated repo
            raise ModelNotFoundError(f"could not read the config of hub model {spec!r}: "
                                     f"{type(exc).__name__}: {exc}") from exc
    from batchrun.models.weights.resolve import resolve_model

    resolve_model(spec, trust_remote_code)  # raises the loader's own explanation
    raise ModelNotFoundError(f"unknown model {spec!r}")  # pragma: no cover


def _gguf_config(gguf: Path, trust_remote_code: bool = False):
    from batchrun.models.config.hf_config import read_config
    from batchrun.models.weights.gguf_check import check_gguf
    from batchrun.models.weights.loader import gguf_cache_path

    converted = gguf_cache_path(gguf)
    if (converted / "config.json").is_file():
        return read_config(converted, trust_remote_code)
    check_gguf(gguf)
    return _auto_config(gguf, trust_remote_code, gguf.parent, gguf_file=gguf.name)


def gguf_file(model: str | None) -> Path | None:
    """The .gguf file `model` (as config_for takes it) loads from, if any: a registry model's,
    a .gguf path, or the source of a converted folder."""
    from batchrun.models.weights import registry
    from batchrun.models.quant.gguf import source_of

    spec = (model or "").strip()
    entry = registry.lookup(registry.DEFAULT_MODEL if spec in ("", "default") else spec)
    if entry is not None:
        return registry.find_gguf(entry)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    return source_of(path) if path.is_dir() else None
