"""A tiny Llama model folder written without transformers (a 64-word WordLevel tokenizer,
random float32 safetensors in Hugging Face's names), for the tests that damage model folders
(tests/fuzz/test_model_folder_fuzz.py, tests/unit/test_remote_code.py), and the CLI calls they
make on it in-process."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = [f"w{i}" for i in range(61)]
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
}
LINE = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
        "body": {"prompt": "w1 w2 w3", "max_tokens": 1, "temperature": 0}}


def weights(config: dict = CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of the Llama `config` describes, under transformers' names."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    return {name: torch.randn(shape, generator=g) * 0.1 for name, shape in shapes.items()}


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: n + 3 for n, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>"}))


def tiny_folder(folder: Path, config: dict = CONFIG) -> Path:
    """Write the tiny model (config.json, model.safetensors, the tokenizer) into `folder`."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights(config), str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(folder)
    return folder


def cli(*args: str, input: str | None = None):
    """`batchrun ARGS...` in this process (the real loader); click's Result (exception kept)."""
    from click.testing import CliRunner

    from batchrun.cli import main

    return CliRunner().invoke(main, list(args), input=input)


def run_on(folder: Path, tmp: Path, *options: str):
    """`batchrun run` of LINE on the model in `folder`, its output under `tmp`."""
    lines = tmp / "in.jsonl"
    lines.write_text(json.dumps(LINE) + "\n")
    return cli("run", str(lines), "--model", str(folder), "-o", str(tmp / "out.jsonl"),
               "--overwrite", "--kv-cache-memory", "1MiB", *options)


def refused(result, *named: str) -> None:
    """`result` is a usage error (exit 2) whose message names each of `named`, no traceback."""
    import traceback

    shown = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        shown += "".join(traceback.format_exception(result.exception))
    assert result.exit_code == 2, shown
    assert "Traceback" not in shown, shown
    for name in named:
        assert name in result.output, (name, result.output)
