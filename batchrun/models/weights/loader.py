"""Model files: what a resolved model is (ModelFiles), and the one-time conversions of a .gguf file
or a *.bin folder into a safetensors folder in the cache.

resolve.py turns a model spec into ModelFiles using these and the registry (registry.py), which
uses them too; this module imports neither. Everything heavy (torch, transformers) is imported
only when a conversion actually happens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from batchrun.paths import cache_dir

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_STALE_TMP_S = 3600
GGUF_SOURCE = "gguf_source.txt"  # in a converted folder: the .gguf it came from


@dataclass(frozen=True)
class ModelFiles:
    name: str  # served model name
    path: Path  # Hugging Face folder: config.json, *.safetensors, tokenizer files, generation_config.json
    aliases: tuple[str, ...] = ()  # other names that mean this model


class ModelNotFoundError(Exception):
    """The model could not be found or fetched; the message tells the user what to do."""


# ---- conversion into the cache -------------------------------------------------------------


def _key(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:12]


def gguf_cache_path(gguf: Path) -> Path:
    """Where the safetensors conversion of `gguf` lives; changes when the file is replaced."""
    gguf = gguf.resolve()
    st = gguf.stat()
    return cache_dir() / "models" / f"{gguf.stem}-{_key(gguf, st.st_size, st.st_mtime_ns)}"


def convert_gguf(gguf: Path) -> Path:
    """The cached safetensors folder of `gguf`, converted now if it is not there yet;
    ModelFolderError names a file that cannot be read or converted."""
    gguf = Path(gguf).resolve()
    folder = _build_once(gguf_cache_path(gguf), lambda tmp: _dequantise_gguf(gguf, tmp), gguf.name)
    source = folder / GGUF_SOURCE  # where --quantization reads the quantized blocks from
    if not source.is_file() or source.read_text() != str(gguf):
        source.write_text(str(gguf))
    return folder


def convert_bin_folder(folder: Path, trust_remote_code: bool = False) -> Path:
    """The cached safetensors conversion of a *.bin folder; each .bin is opened first (tensors
    only: torch.load's weights_only) so a damaged or hostile pickle is refused by name."""
    folder = folder.resolve()
    stats = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.glob("*.bin"))
    target = cache_dir() / "models" / f"{folder.name}-{_key(folder, stats)}"

    def build(tmp: Path) -> None:
        from batchrun.models.errors import naming

        check_bin_files(sorted(folder.glob("*.bin")))
        with naming(folder, "its *.bin weights cannot be converted"):
            _bin_to_safetensors(folder, tmp, trust_remote_code)

    return _build_once(target, build, folder.name)


def check_bin_files(files: list[Path]) -> None:
    """ModelFolderError naming the first .bin torch.load cannot read as tensors alone (read
    onto the meta device: nothing allocated)."""
    import pickle
    import warnings
    import zipfile

    import torch

    from batchrun.models.errors import ModelFolderError, naming

    for f in files:
        try:
            with naming(f, "not a readable PyTorch checkpoint"), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's note on the pickle protocol
                torch.load(f, map_location="meta", weights_only=True, mmap=zipfile.is_zipfile(f))
        except ModelFolderError as exc:
            if isinstance(exc.__cause__, pickle.UnpicklingError):
                raise ModelFolderError(f"{f}: not a PyTorch checkpoint of tensors alone (its "
                                       "pickle is damaged or holds other objects, which "
                                       "batchrun does not unpickle)") from exc
            raise


def _build_once(target: Path, build, what: str) -> Path:
    """Build `target` in a temp folder beside it and rename it into place.

    The rename is atomic, so a crash leaves no half-written cache entry, and when two processes
    race the loser's rename fails against the winner's complete folder and is discarded.
    """
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}.tmp-"
    for stale in target.parent.glob(prefix + "*"):  # left behind by a crashed conversion
        if time.time() - stale.stat().st_mtime > _STALE_TMP_S:
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        print(f"batchrun: converting {what} to safetensors in {target} (once)", file=sys.stderr)
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _dequantise_gguf(gguf: Path, out: Path) -> None:
    """`gguf` as safetensors in `out`, its header and tensor extents checked first
    (weights/gguf_check.py)."""
    from batchrun.models.errors import naming
    from batchrun.models.weights.gguf_check import check_gguf

    check_gguf(gguf)
    with naming(gguf, "cannot be converted"):
        _convert_gguf(gguf, out)


def _convert_gguf(gguf: Path, out: Path) -> None:
    from batchrun.models.weights import gguf_weights

    if not gguf_weights.supports(gguf):
        return _dequantise_gguf_transformers(gguf, out)
    from concurrent.futures import ThreadPoolExecutor

    # The tokenizer (transformers' GGUF tokenizer conversion) beside the weights (numpy).
    with ThreadPoolExecutor(1) as pool:
        tokenizer = pool.submit(_gguf_tokenizer, gguf, out)
        gguf_weights.convert(gguf, out)
        tokenizer.result()


def _gguf_tokenizer(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    from batchrun.models.weights.remote_code import auto_kwargs

    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                  **auto_kwargs(False)).save_pretrained(out)


def _dequantise_gguf_transformers(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import GgufConfig

    from batchrun.models.weights.remote_code import auto_kwargs

    # dequantize=True: dense float32 weights even where transformers could keep them packed in
    # GGUF blocks (those cannot be saved as safetensors).
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
        **auto_kwargs(False),  # a GGUF holds no code; its folder's JSON files are not its
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    _gguf_tokenizer(gguf, out)
    _strip_quantization_config(out / "config.json")


def _bin_to_safetensors(folder: Path, out: Path, trust_remote_code: bool) -> None:
    from transformers import AutoModelForCausalLM

    from batchrun.models.weights.remote_code import auto_kwargs

    AutoModelForCausalLM.from_pretrained(folder, dtype="auto", **auto_kwargs(trust_remote_code)
                                         ).save_pretrained(out)
    for item in folder.iterdir():  # tokenizer and the rest, as shipped
        if item.is_file() and item.suffix not in WEIGHT_SUFFIXES and not (out / item.name).exists():
            if not item.name.endswith(".bin.index.json"):
                shutil.copy2(item, out / item.name)
    _strip_quantization_config(out / "config.json")


def _strip_quantization_config(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
