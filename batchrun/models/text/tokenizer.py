"""A model folder's tokenizer through the `tokenizers` library and Jinja, without transformers.

`load_tokenizer(folder)` reads tokenizer.json, tokenizer_config.json and the chat template
(chat_template.jinja or the config's), and gives the part of transformers' fast-tokenizer
interface batchrun uses: __call__ / encode / decode / convert_ids_to_tokens / get_added_vocab /
apply_chat_template / eos_token_id / chat_template / backend_tokenizer. Importing transformers
and building its tokenizer costs well over a second of every cold start; this costs a tenth.
A folder this does not cover (no tokenizer.json, or a tokenizer class that rewrites the file's
pipeline) gets transformers' AutoTokenizer. tests/unit/test_tokenizer_parity.py compares both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchrun.models.weights.json_file import read_object
from batchrun.models.weights.remote_code import auto_kwargs, check_folder
from batchrun.models.errors import naming
from batchrun.models.text.chat_template import render

# tokenizer_config.json classes that take tokenizer.json as it is (transformers 5 names the
# generic one TokenizersBackend); others (LlamaTokenizer, Qwen2Tokenizer, ...) may rebuild parts.
PLAIN_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer",
                 "GPT2TokenizerFast"}
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken serialised: {"content": ...}
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, backend: Any, config: dict[str, Any], chat_template: str | None):
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens_map = {n: _token_text(config.get(n)) for n in SPECIAL_NAMES
                                   if _token_text(config.get(n)) is not None}
        for name in SPECIAL_NAMES:
            text = self.special_tokens_map.get(name)
            setattr(self, name, text)
            setattr(self, f"{name}_id", backend.token_to_id(text) if text is not None else None)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))

    # --- encoding ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True,
               text_pair: str | None = None) -> list[int]:
        return self.backend_tokenizer.encode(text, text_pair,
                                             add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True,
                 **_: Any) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens, text_pair)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    # --- decoding ---------------------------------------------------------------------------

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        text = self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def get_added_vocab(self) -> dict[str, int]:
        return {t.content: i for i, t in self.backend_tokenizer.get_added_tokens_decoder().items()}

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    # --- chat -------------------------------------------------------------------------------

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            return_dict: bool = True, **kwargs: Any) -> Any:
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template; pass --chat-template")
        text = render(template, conversation, self.special_tokens_map, tools=tools,
                      add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, **kwargs)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization (spaces before punctuation and contractions)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _read_json(path: Path) -> dict[str, Any]:
    return read_object(path) if path.is_file() else {}


def plain_tokenizer(folder: Path) -> Tokenizer | None:
    """The folder's tokenizer without transformers, or None when this cannot promise the same
    tokens as transformers (then the caller uses AutoTokenizer)."""
    folder = Path(folder)
    config = _read_json(folder / "tokenizer_config.json")
    if not (folder / "tokenizer.json").is_file():
        return None
    if config.get("tokenizer_class", "PreTrainedTokenizerFast") not in PLAIN_CLASSES:
        return None
    if config.get("add_bos_token") or config.get("add_eos_token"):  # rebuilt post-processors
        return None
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(str(folder / "tokenizer.json"))
    have = {t.content for t in backend.get_added_tokens_decoder().values()}
    if any(t.get("content") not in have for t in (config.get("added_tokens_decoder") or {}).values()):
        return None  # tokens only the config adds: transformers decides their ids
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return Tokenizer(backend, config, template)


def load_tokenizer(folder: str | Path, trust_remote_code: bool = False) -> Any:
    """plain_tokenizer(folder), else transformers' AutoTokenizer; the folder's own tokenizer
    code only when `trust_remote_code` (models/weights/remote_code.py). ModelFolderError names
    the folder when its tokenizer files cannot be read."""
    check_folder(folder, trust_remote_code)
    with naming(folder, "its tokenizer files cannot be read"):
        tokenizer = plain_tokenizer(Path(folder))
        if tokenizer is not None:
            return tokenizer
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, **auto_kwargs(trust_remote_code))
