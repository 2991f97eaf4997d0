"""Sliding-window layers' KV blocks handed back (engine/kv_groups.py, engine/kv_cache.py), end to
end on the transformers backend: tiny Gemma 2 / Gemma 3 / windowed Mistral with windows of a
few tokens and long prompts, against transformers' generate, through batching, chunked prefill
across the window's boundary, a prefix-cache hit and preemption, while the engine holds fewer
blocks than a cache of every layer's every block would."""

import pytest
import torch

from batchrun.engine import SamplingParams
from batchrun.engine.kv_cache import FREED
from batchrun.llm import build_engine, load_weights
from batchrun.options.engine import EngineConfig
from tests.parity import ParityReport
from tests.tiny_models import BACKEND_ARCHS, IdTokenizer, make_tiny
from tests.unit.test_transformers_backend import MAX_TOKENS, check_against_transformers

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")
BS, WINDOW, CHUNK = 4, 6, 16  # a window of 6 tokens: block boundaries fall inside it
# (architecture, its layers' kinds): Gemma 3's 5 windowed layers in 6, Gemma 2's alternation,
# Mistral with every layer windowed
MODELS = {
    "gemma3_text": ["sliding_attention"] * 5 + ["full_attention"],
    "gemma2": ["sliding_attention", "full_attention"] * 2,
    "mistral": None,
}


def windowed_engine(arch, path, num_blocks):
    types = MODELS[arch]
    overrides = dict(sliding_window=WINDOW, num_hidden_layers=len(types) if types else 2)
    if types:
        overrides["layer_types"] = types
    hf = make_tiny(arch, path, archs=BACKEND_ARCHS, **overrides)
    config = EngineConfig.default(model_impl="transformers", block_size=BS,
                                  max_num_batched_tokens=CHUNK, num_blocks=num_blocks)
    model = load_weights(path, config, CPU, torch.float32)
    return hf, build_engine(model, IdTokenizer(), config, [2], CPU, torch.float32)


def full_cache_blocks(engine, lengths) -> int:
    """Blocks (of this engine's size) a cache keeping every block of every layer would hold."""
    groups = engine.kv.groups
    per_token_block = len(groups.groups)  # every group keeping all of a sequence's blocks
    return sum(-(-n // BS) * per_token_block for n in lengths)


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_windowed_models_match_transformers_holding_fewer_blocks(arch, tmp_path):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    report = ParityReport()
    hf, engine = windowed_engine(arch, tmp_path / "roomy", num_blocks=400)
    windows = engine.kv.groups.windows
    assert windows.count(WINDOW) == len(windows) - (MODELS[arch] is not None)
    gen = torch.Generator().manual_seed(5)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (61, 9, 44, 30)]
    outs = engine.generate(prompts, params)  # one batch, prefilled in chunks of 16 tokens
    check_against_transformers(hf, prompts, outs, arch, report)
    assert engine.stats.num_preemptions == 0
    lengths = [len(p) + MAX_TOKENS for p in prompts]
    full = full_cache_blocks(engine, lengths)
    # every full group keeps its blocks; a window group at most the window's, the chunk's, one
    bound = sum(engine.kv.blocks_needed(n, CHUNK) for n in lengths)
    assert engine.kv.peak_used <= bound < full

    # A follow-up turn: the first conversation, its answer and more: the window group still
    # holds the blocks just before the hit point (handed back last, at its end).
    turn = prompts[0] + outs[0].outputs[0].token_ids + [7, 8, 9]
    cached = engine.stats.cached_tokens
    check_against_transformers(hf, [turn], engine.generate([turn], params), arch, report)
    assert engine.stats.cached_tokens - cached == (len(turn) - 1) // BS * BS == 72

    # The same batch in a pool that holds only part of it: preemption and recomputation.
    hf, tight = windowed_engine(arch, tmp_path / "tight", num_blocks=bound // 3)
    check_against_transformers(hf, prompts, tight.generate(prompts, params), arch, report)
    assert tight.stats.num_preemptions > 0
    assert tight.kv.num_free_blocks == tight.kv.num_blocks
    assert report.compared == 9


def test_a_running_window_group_holds_only_its_window(tmp_path):
    """At every step, the blocks of a windowed layer that a sequence holds begin at the window
    of the step's first query token (chunks of 16 tokens, then decodes)."""
    _, engine = windowed_engine("gemma3_text", tmp_path, num_blocks=400)
    execute = engine.runner.execute
    seen = []

    def checked(work):
        for req, _ in work:
            c = req.num_computed_tokens
            for table, window in zip(req.block_ids, engine.kv.groups.windows):
                held = [i for i, b in enumerate(table) if b != FREED]
                first = 0 if window is None else max(0, c - window + 1) // BS
                assert held == list(range(first, len(table))), (c, window, table)
                seen.append(first)
        return execute(work)

    engine.runner.execute = checked
    engine.generate([list(range(3, 80))], SamplingParams(max_tokens=6, ignore_eos=True))
    assert max(seen) == (82 - WINDOW + 1) // BS
