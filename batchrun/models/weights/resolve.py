"""Turn a model spec (registry name, HF folder, .gguf file, hub id) into a Hugging Face folder on disk.

Everything heavy (torch, transformers, huggingface_hub) is imported only when a conversion or a
download actually happens, so resolving an already cached model costs a few stat calls.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from batchrun.models.weights import registry
from batchrun.models.weights.loader import ModelFiles, ModelNotFoundError, convert_bin_folder, convert_gguf

HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "merges.txt", "vocab.*"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(spec: str | None = None, trust_remote_code: bool = False) -> ModelFiles:
    """The Hugging Face folder `spec` names (converted once from a .gguf or *.bin folder); a
    folder that ships code is refused unless `trust_remote_code` (ModelFolderError)."""
    if spec is None or spec.strip() in ("", "default"):
        spec = registry.DEFAULT_MODEL
    spec = spec.strip()
    entry = registry.lookup(spec)
    if entry is not None:
        return registry.resolve_entry(entry)

    path = Path(spec).expanduser()
    if path.is_dir():
        return from_folder(path, spec, trust_remote_code)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _aliased(path.stem, convert_gguf(path), spec, path.name, str(path.resolve()))
        raise ModelNotFoundError(
            f"{spec!r} is a file but not a .gguf file. Pass a .gguf file, a Hugging Face model "
            f"folder (with config.json and *.safetensors), a hub id, or one of: {registry.known_names()}."
        )
    if HUB_ID.match(spec):
        return _from_hub(spec, trust_remote_code)
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


def from_folder(folder: Path, spec: str, trust_remote_code: bool = False) -> ModelFiles:
    from batchrun.models.weights.remote_code import check_folder

    folder = folder.resolve()
    if not (folder / "config.json").is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        hint = f" It holds {ggufs[0].name}: pass that file instead." if ggufs else ""
        raise ModelNotFoundError(f"{folder} is not a Hugging Face model folder: it has no config.json.{hint}")
    check_folder(folder, trust_remote_code)
    if any(folder.glob("*.safetensors")):
        return _aliased(folder.name, folder, spec, str(folder))
    if any(folder.glob("*.bin")):
        return _aliased(folder.name, convert_bin_folder(folder, trust_remote_code), spec,
                        str(folder))
    raise ModelNotFoundError(f"{folder} has a config.json but no *.safetensors or *.bin weights.")


def _from_hub(repo_id: str, trust_remote_code: bool) -> ModelFiles:
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
    local = Path(folder)
    from batchrun.models.weights.remote_code import check_folder

    check_folder(local, trust_remote_code)
    if not any(local.glob("*.safetensors")):
        raise ModelNotFoundError(
            f"{repo_id!r} on the hub has no *.safetensors weights; download it by other means and "
            f"pass its local folder."
        )
    return _aliased(repo_id, local)
