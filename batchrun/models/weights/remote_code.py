"""A model folder's own Python code runs only under --trust-remote-code, and nothing ever asks.

transformers runs the code a folder names in `auto_map` (config.json, tokenizer_config.json,
the processor files) when trust_remote_code is true, and when it is left unset it asks "Do you
wish to run the custom code? [y/N]" on stdin, where a batch run's input may be: `yes y | ...`
ran the folder's Python, and with the batch on stdin the prompt ate its first line. So:

- check_folder refuses, before transformers reads the folder, any folder whose JSON files name
  code, unless the operator trusted it (ModelFolderError naming the file and the flag: exit 2);
- every call into transformers that can run such code passes auto_kwargs(trusted): an explicit
  trust_remote_code, after never_prompt() made transformers' prompt path raise instead of
  reading stdin (its timeout set to 0), should some call inside transformers leave it unset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from batchrun.models.weights.json_file import read_object
from batchrun.models.errors import ModelFolderError

FLAG = "--trust-remote-code"
# JSON files whose auto_map transformers' Auto* classes follow; tokenizer.json (the tokenizers
# library's, megabytes) and weight indexes name no code.
SKIPPED = ("tokenizer.json",)


def code_references(folder: str | Path) -> list[tuple[Path, list[str]]]:
    """(file, the code it names) for each JSON file at the top of `folder` with an auto_map
    (at its top level or in a nested config)."""
    found = []
    for path in sorted(Path(folder).glob("*.json")):
        if path.name in SKIPPED or path.name.endswith(".index.json"):
            continue
        try:
            config = read_object(path)
        except ModelFolderError:  # what transformers cannot parse either runs no code
            continue
        names = _auto_map_names(config)
        if names:
            found.append((path, names))
    return found


def _auto_map_names(config: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for value in (config, *(v for v in config.values() if isinstance(v, dict))):
        auto_map = value.get("auto_map")
        entries: Iterable[Any]
        if isinstance(auto_map, dict):
            entries = auto_map.values()
        elif isinstance(auto_map, (list, tuple)):  # an older tokenizer_config's [slow, fast]
            entries = [auto_map]
        else:
            continue
        for entry in entries:
            for name in entry if isinstance(entry, (list, tuple)) else [entry]:
                if name and str(name) not in names:
                    names.append(str(name))
    return names


def check_folder(folder: str | Path, trusted: bool) -> None:
    """ModelFolderError naming the first file that names code, unless `trusted`."""
    if trusted or not Path(folder).is_dir():
        return
    found = code_references(folder)
    if found:
        path, names = found[0]
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ModelFolderError(
            f"{path}: its auto_map names Python code the model folder ships ({shown}); batchrun "
            f"does not run a model folder's code unless you pass {FLAG} (trust_remote_code = true "
            "in a job or sweep spec's [engine]; read that code first: it runs with your "
            "permissions)")


def never_prompt() -> None:
    """transformers raises instead of asking on stdin whenever trust_remote_code is unset."""
    from transformers import dynamic_module_utils

    dynamic_module_utils.TIME_OUT_REMOTE_CODE = 0


def auto_kwargs(trusted: bool) -> dict[str, Any]:  # keyword arguments, spread into calls
    """The keyword every transformers call that may run a folder's code gets."""
    never_prompt()
    return {"trust_remote_code": bool(trusted)}


def config_kwargs(hf: Any) -> dict[str, bool]:
    """auto_kwargs for Auto*.from_config(hf). A config carries an auto_map only where its
    folder was trusted (check_folder and refuse_config_code stop it otherwise), so its code
    may run; any other config names none."""
    return auto_kwargs(bool(getattr(hf, "auto_map", None)))


def refuse_config_code(config: Any, source: str | Path, trusted: bool) -> None:
    """ModelFolderError for a config transformers read from where check_folder cannot look (a
    hub repository, a GGUF's metadata) that names code, unless `trusted`."""
    names = _auto_map_names({"auto_map": getattr(config, "auto_map", None)})
    if names and not trusted:
        raise ModelFolderError(f"{source}: its config's auto_map names Python code "
                               f"({', '.join(names[:3])}); batchrun runs it only with {FLAG}")
