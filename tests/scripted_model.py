"""A stand-in model that emits recorded token sequences through the real engine.

Random weights never write `<tool_call>` or `</think>`, so tool and reasoning paths are tested
end to end with this: the engine, scheduler, KV cache, sampler and detokenizer are the real ones;
only the forward pass is a lookup. The model sees rows of (token, position), not sequences, so a
script is keyed by the length of the prompt it follows: at the last prompt position it emits
the script's first token, and so on, then EOS.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from batchrun.options.engine import EngineConfig
from batchrun.llm import LoadedModel, build_engine

EOS = 2


class ScriptedModel(torch.nn.Module):
    def __init__(self, vocab_size: int, max_len: int = 2048):
        super().__init__()
        self.vocab_size = vocab_size
        self.num_labels = 0  # a causal LM (engine/model.py's NativeModel)
        self.scripts: dict[int, list[int]] = {}
        self.config = SimpleNamespace(num_heads=1, num_kv_heads=1, head_dim=1, num_layers=0,
                                      vocab_size=vocab_size, max_position_embeddings=max_len,
                                      kv_bytes_per_token=2)

    def forward(self, input_ids, positions, kv_caches, meta):
        return positions.to(torch.float32)[:, None]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros((hidden.shape[0], self.vocab_size))
        for row, pos in enumerate(hidden[:, 0].long().tolist()):
            logits[row, self.next_token(pos)] = 50.0
        return logits

    def next_token(self, position: int) -> int:
        # The latest-starting script that covers the position: a longer prompt's script.
        for prompt_len in sorted(self.scripts, reverse=True):
            i = position + 1 - prompt_len
            if 0 <= i < len(self.scripts[prompt_len]):
                return self.scripts[prompt_len][i]
        return EOS


def scripted_model(tokenizer, name: str = "scripted", eos=(EOS,), path=None) -> LoadedModel:
    """`eos`: the ids that end a generation (a checkpoint's generation_config may list
    several); `path`: the model folder the adapter reads (its config.json)."""
    model = ScriptedModel(len(tokenizer))
    config = EngineConfig.default(num_blocks=512)
    config.device.device = "cpu"
    engine = build_engine(model, tokenizer, config, list(eos), torch.device("cpu"), torch.float32)
    return LoadedModel(engine, tokenizer, name, (), {}, path)


def script(loaded: LoadedModel, prompt: list[int], text: str, keep: bool = False) -> list[int]:
    """Make the model answer `prompt` with `text` (+ EOS); returns the scripted token ids.
    Earlier scripts are dropped unless `keep` (then prompts must differ in length)."""
    ids = loaded.tokenizer.encode(text) + [EOS]
    scripts = loaded.engine.runner.model.scripts
    if not keep:
        scripts.clear()
    scripts[len(prompt)] = ids
    return ids
