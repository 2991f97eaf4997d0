"""Turn a model spec (registry name, HF folder, .gguf file, hub id) into a Hugging Face folder on disk.

Everything heavy (torch, transformers, huggingface_hub) is imported only when a conversion or a
download actually happens, so resolving an already cached model costs a few stat calls.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import platformdirs

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "merges.txt", "vocab.*"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_STALE_TMP_S = 3600


@dataclass(frozen=True)
class ModelFiles:
    name: str  # served model name
    path: Path  # Hugging Face folder: config.json, *.safetensors, tokenizer files, generation_config.json
    aliases: tuple[str, ...] = ()  # other names that mean this model


class ModelNotFoundError(Exception):
    """The model could not be found or fetched; the message tells the user what to do."""


def cache_dir() -> Path:
    env = os.environ.get("BATCHRUN_CACHE")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("batchrun"))


def resolve_model(spec: str | None = None) -> ModelFiles:
    from batchrun.models import registry  # registry imports this module

    if spec is None or spec.strip() in ("", "default"):
        spec = registry.DEFAULT_MODEL
    spec = spec.strip()
    entry = registry.lookup(spec)
    if entry is not None:
        return registry.resolve_entry(entry)

    path = Path(spec).expanduser()
    if path.is_dir():
        return _from_folder(path, spec)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _aliased(path.stem, convert_gguf(path), spec, path.name, str(path.resolve()))
        raise ModelNotFoundError(
            f"{spec!r} is a file but not a .gguf file. Pass a .gguf file, a Hugging Face model "
            f"folder (with config.json and *.safetensors), a hub id, or one of: {registry.known_names()}."
        )
    if _HUB_ID.match(spec):
        return _from_hub(spec)
    raise ModelNotFoundError(
        f"Unknown model {spec!r}. Tried: the model registry (known names: {registry.known_names()}), "
        f"a local path (no such file or folder), and a Hugging Face hub id (needs the form "
        f"'org/name'). Run `batchrun models list` to see the known models."
    )


def _aliased(name: str, path: Path, *aliases: str) -> ModelFiles:
    seen: list[str] = []
    for alias in aliases:
        if alias and alias != name and alias not in seen:
            seen.append(alias)
    return ModelFiles(name=name, path=path, aliases=tuple(seen))


def _from_folder(folder: Path, spec: str) -> ModelFiles:
    folder = folder.resolve()
    if not (folder / "config.json").is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        hint = f" It holds {ggufs[0].name}: pass that file instead." if ggufs else ""
        raise ModelNotFoundError(f"{folder} is not a Hugging Face model folder: it has no config.json.{hint}")
    if any(folder.glob("*.safetensors")):
        return _aliased(folder.name, folder, spec, str(folder))
    if any(folder.glob("*.bin")):
        return _aliased(folder.name, convert_bin_folder(folder), spec, str(folder))
    raise ModelNotFoundError(f"{folder} has a config.json but no *.safetensors or *.bin weights.")


def _from_hub(repo_id: str) -> ModelFiles:
    # Offline machines must fail fast rather than wait on the default timeouts; both are read
    # when huggingface_hub is first imported, so they only apply if it was not imported yet.
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelNotFoundError(
            f"{repo_id!r} looks like a Hugging Face hub id, but huggingface_hub is not installed. "
            f"Download the model elsewhere and pass its folder instead."
        ) from None
    try:
        folder = snapshot_download(
            repo_id, allow_patterns=HUB_ALLOW_PATTERNS, etag_timeout=5, local_files_only=offline
        )
    except Exception as exc:  # offline, unknown repo, gated repo, ...: all end the same way for the user
        where = "HF_HUB_OFFLINE is set and it is not in the local hub cache" if offline else (
            "the Hugging Face hub could not be reached or refused it"
        )
        detail = str(exc).splitlines()[0] if str(exc) else ""
        raise ModelNotFoundError(
            f"{repo_id!r} is neither a known model name nor a local path, and could not be fetched as a "
            f"Hugging Face hub id: {where} ({type(exc).__name__}: {detail}). Download the model on a machine with access "
            f"and pass its local folder or .gguf file, or use the bundled default `smollm2-135m`."
        ) from exc
    folder = Path(folder)
    if not any(folder.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"{repo_id!r} on the hub has no *.safetensors weights; download it by other means and "
            f"pass its local folder."
        )
    return _aliased(repo_id, folder)


# ---- conversion into the cache -------------------------------------------------------------


def _key(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:12]


def gguf_cache_path(gguf: Path) -> Path:
    """Where the safetensors conversion of `gguf` lives; changes when the file is replaced."""
    gguf = gguf.resolve()
    st = gguf.stat()
    return cache_dir() / "models" / f"{gguf.stem}-{_key(gguf, st.st_size, st.st_mtime_ns)}"


def convert_gguf(gguf: Path) -> Path:
    gguf = Path(gguf).resolve()
    return _build_once(gguf_cache_path(gguf), lambda tmp: _dequantise_gguf(gguf, tmp), gguf.name)


def convert_bin_folder(folder: Path) -> Path:
    folder = folder.resolve()
    stats = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.glob("*.bin"))
    target = cache_dir() / "models" / f"{folder.name}-{_key(folder, stats)}"
    return _build_once(target, lambda tmp: _bin_to_safetensors(folder, tmp), folder.name)


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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    # dequantize=True: dense float32 weights even where transformers could keep them packed in
    # GGUF blocks (those cannot be saved as safetensors).
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
    )
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    _strip_quantization_config(out / "config.json")


def _bin_to_safetensors(folder: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(folder, dtype="auto").save_pretrained(out)
    for item in folder.iterdir():  # tokenizer and the rest, as shipped
        if item.is_file() and item.suffix not in WEIGHT_SUFFIXES and not (out / item.name).exists():
            if not item.name.endswith(".bin.index.json"):
                shutil.copy2(item, out / item.name)
    _strip_quantization_config(out / "config.json")


def _strip_quantization_config(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    if config.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
