"""--batch-invariant: a request's tokens and logprobs are bitwise the same run alone, in a batch
of 7 or 64 at any place, after a prefix-cache hit on its prompt, and with its prefill chunked
at different splits; greedy and seeded sampling (top-k, top-p, n=2) alike. On a tiny random
Llama with the bundled tokenizer's vocabulary; its greedy tokens also match transformers'."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchrun import llm
from batchrun.engine.sampling_params import SamplingParams
from batchrun.models.transformers.support import UnsupportedModelError
from batchrun.options.engine import EngineConfig
from tests.parity import assert_greedy_match
from tests.tiny_models import make_tiny

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smol_tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama")
    # A GEMM inner dimension of 1,024: wide enough for oneDNN's kernels to sum differently by
    # row count in the default mode.
    make_tiny("llama", path, vocab_size=len(smol_tokenizer), intermediate_size=1024)
    smol_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def loaded(folder):
    return llm.load_from_path(folder, EngineConfig.default(batch_invariant=True))


def engine(loaded, **overrides):
    """A fresh engine (empty KV cache) over the loaded invariant model."""
    config = EngineConfig.default(batch_invariant=True, block_size=4, **overrides)
    return llm.build_engine(loaded.engine.runner.model, loaded.tokenizer, config,
                            loaded.eos_token_ids, torch.device("cpu"), torch.float32)


def prompt(seed: int, length: int | None = None) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(length or rng.randint(5, 40))]


# The requests whose outputs are compared, and the mix of others around them.
TARGETS = [
    (prompt(1, 37), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5,
                                   ignore_eos=True)),
    (prompt(2, 23), SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=MAX_TOKENS,
                                   logprobs=3, ignore_eos=True)),
    (prompt(3, 30), SamplingParams(temperature=1.1, top_p=0.9, seed=11, n=2,
                                   max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)),
]


def other(i: int) -> tuple[list[int], SamplingParams]:
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=5 + i % 50),
             dict(temperature=0.7, top_p=0.8), dict(temperature=1.0, seed=i)]
    # Half of them begin with a target's prompt: in a batch they share its cached blocks.
    start = TARGETS[i % 3][0][:16] if i % 2 == 0 else []
    return start + prompt(100 + i), SamplingParams(max_tokens=1 + i % MAX_TOKENS, logprobs=1 + i % 4,
                                           ignore_eos=True, **kinds[i % 4])


def result(out) -> list:
    """Every choice's tokens and logprobs (chosen and top alternatives), bit for bit."""
    return [(c.token_ids, [(lp.logprob, lp.top) for lp in c.logprobs]) for c in out.outputs]


def run(eng, work):
    return [result(o) for o in eng.generate([p for p, _ in work], [s for _, s in work])]


@pytest.fixture(scope="module")
def alone(loaded):
    """Each target run on its own in a fresh engine."""
    return [run(engine(loaded), [t])[0] for t in TARGETS]


@pytest.mark.parametrize("size,places", [(7, (0, 3, 6)), (64, (5, 31, 63))])
def test_a_request_gives_the_same_bits_in_a_batch_at_any_place(loaded, alone, size, places):
    work = [other(i) for i in range(size)]
    for place, target in zip(places, TARGETS):
        work[place] = target
    got = run(engine(loaded), work)
    for place, expected in zip(places, alone):
        assert got[place] == expected


def test_a_prefix_cache_hit_gives_the_same_bits_as_a_miss(loaded, alone):
    eng = engine(loaded)
    # Earlier requests leave the targets' prompts, all but their last tokens, in the cache.
    eng.generate([p[:-3] for p, _ in TARGETS], SamplingParams(max_tokens=1))
    outs = eng.generate([p for p, _ in TARGETS], [s for _, s in TARGETS])
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert [result(o) for o in outs] == alone


def test_rows_on_a_long_shared_prefix_give_the_same_bits_as_alone(loaded):
    """Requests on one 150-token prefix (many of the kernel's tiles: its blocks read once for a
    group, each row scored as alone) give each the bits it gets alone, decoding side by side
    and after the prefix's prefill, chunked or not."""
    shared = prompt(7, 150)
    work = [(shared + prompt(200 + i, 3 + 5 * i), SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)) for i in range(6)]
    alone_runs = [run(engine(loaded), [w])[0] for w in work]
    assert run(engine(loaded), work) == alone_runs
    assert run(engine(loaded, max_num_batched_tokens=37), work) == alone_runs
    eng = engine(loaded)
    eng.generate([shared], SamplingParams(max_tokens=1))  # the prefix cached first
    outs = eng.generate([p for p, _ in work], [s for _, s in work])
    assert all(o.num_cached_tokens >= 148 for o in outs)
    assert [result(o) for o in outs] == alone_runs


@pytest.mark.parametrize("budget", [5, 13])
def test_chunked_prefill_gives_the_same_bits_at_any_split(loaded, alone, budget):
    eng = engine(loaded, max_num_batched_tokens=budget)
    assert run(eng, TARGETS) == alone


def test_greedy_tokens_match_transformers(folder, loaded, alone):
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids, params = TARGETS[0]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, eos_token_id=None)
    ref = out.sequences[0, len(ids):].tolist()
    assert_greedy_match(alone[0][0][0], ref, [s[0] for s in out.scores], "invariant greedy")


def test_the_engine_says_what_it_runs(loaded):
    assert loaded.engine.config.batch_invariant
    assert loaded.engine.runner.attention.name == "cpu-invariant"


@pytest.mark.parametrize("options,named", [({"quantization": "int8-weight"}, "--quantization"),
                                           ({"model_impl": "transformers"},
                                            "the transformers backend")])
def test_what_it_does_not_cover_is_refused_by_name(folder, options, named):
    with pytest.raises(UnsupportedModelError, match=f"--batch-invariant does not cover {named}"):
        llm.load_from_path(folder, EngineConfig.default(batch_invariant=True, **options))


def test_run_serve_and_job_specs_take_the_option(tmp_path):
    from click.testing import CliRunner

    from batchrun.batch.shell.jobspec import JobSpecError, load
    from batchrun.cli import main

    for command in ("run", "serve"):
        help_text = CliRunner().invoke(main, [command, "--help"]).output
        assert "--batch-invariant" in help_text, command
    spec = tmp_path / "job.toml"
    spec.write_text('input = "in.jsonl"\noutput = "out.jsonl"\n[engine]\nbatch_invariant = true\n')
    assert load(str(spec)).engine.batch_invariant is True
    spec.write_text('input = "in.jsonl"\noutput = "out.jsonl"\n[engine]\nbatch_invariant = "on"\n')
    with pytest.raises(JobSpecError, match="batch_invariant"):
        load(str(spec))


@pytest.mark.parametrize("arch,module", [("gemma2", "gemma"), ("stablelm", "stablelm"),
                                         ("bloom", "bloom"), ("falcon", "falcon"),
                                         ("gpt_neo", "gpt_neo")])
def test_other_native_families_give_the_same_bits_in_a_batch(arch, module, tmp_path,
                                                             smol_tokenizer):
    """Native Gemma 2 (8-token windows on alternate layers, soft-capped scores and logits, two KV
    groups): the invariant attention takes each layer's window and cap. Native StableLM:
    LayerNorms, per-head q/k norms and partial rotary are as invariant as the rest. BLOOM
    (ALiBi, on the reference attention), Falcon (K/V groups, two norms), GPT-Neo (learned
    positions, windowed local layers)."""
    from tests.tiny_models import BACKEND_ARCHS

    make_tiny(arch, tmp_path, archs=BACKEND_ARCHS, vocab_size=len(smol_tokenizer),
              intermediate_size=1024)
    smol_tokenizer.save_pretrained(tmp_path)
    loaded = llm.load_from_path(tmp_path, EngineConfig.default(batch_invariant=True))
    assert type(loaded.engine.runner.model).__module__ == f"batchrun.models.arch.{module}"
    solo = [run(engine(loaded), [t])[0] for t in TARGETS]
    work = [other(i) for i in range(20)]
    for place, target in zip((0, 9, 19), TARGETS):
        work.insert(place, target)
    batch = run(engine(loaded), work)
    assert [batch[p] for p in (0, 9, 19)] == solo


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_mixture_of_experts_models_are_refused(arch, tmp_path):
    from tests.tiny_models import BACKEND_ARCHS

    make_tiny(arch, tmp_path, archs=BACKEND_ARCHS)
    with pytest.raises(UnsupportedModelError, match="does not cover mixture-of-experts models"):
        llm.load_from_path(tmp_path, EngineConfig.default(batch_invariant=True))


def test_hybrid_linear_attention_models_are_refused(tmp_path):
    from tests.tiny_models import NATIVE_STATE_ARCHS

    make_tiny("qwen3_next", tmp_path, archs=NATIVE_STATE_ARCHS)
    with pytest.raises(UnsupportedModelError, match="does not cover hybrid linear-attention"):
        llm.load_from_path(tmp_path, EngineConfig.default(batch_invariant=True))


def test_bfloat16_on_amx_runs_invariant_unasked(folder):
    """On a CPU with AMX every bfloat16 linear is batchrun's row-invariant GEMM, so bfloat16
    takes the invariant path unasked (the same bits after a prefix-cache hit); elsewhere it is
    the default path unless asked."""
    from tests.helpers import cpu_has

    loaded = llm.load_from_path(folder, EngineConfig.default(dtype="bfloat16"))
    amx = cpu_has("amx_bf16")
    assert loaded.engine.config.batch_invariant == amx
    if not amx:
        return
    eng = lambda: llm.build_engine(loaded.engine.runner.model, loaded.tokenizer,  # noqa: E731
                                   EngineConfig.default(batch_invariant=True, block_size=4),
                                   loaded.eos_token_ids, torch.device("cpu"), torch.bfloat16)
    alone = [run(eng(), [t])[0] for t in TARGETS]
    cached = eng()
    cached.generate([p[:-3] for p, _ in TARGETS], SamplingParams(max_tokens=1))
    outs = cached.generate([p for p, _ in TARGETS], [s for _, s in TARGETS])
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert [result(o) for o in outs] == alone


@pytest.fixture(scope="module")
def loaded_int8(folder):
    return llm.load_from_path(folder, EngineConfig.default(quantization="int8"))


def test_int8_gives_the_same_bits_in_a_batch_and_after_a_prefix_hit(loaded_int8):
    """int8 amplifies a last-bit difference into a changed rounding of an activation, so its
    greedy answers would move with the batch or a prefix hit: it runs invariant unasked."""
    assert loaded_int8.engine.config.batch_invariant
    assert loaded_int8.engine.runner.attention.name == "cpu-invariant"
    assert type(loaded_int8.engine.runner.model.layers[0].mlp.down_proj).__name__ == "Int8Linear"
    alone = [run(engine(loaded_int8), [t])[0] for t in TARGETS]
    work = [other(i) for i in range(7)]
    for place, target in zip((0, 3, 6), TARGETS):
        work[place] = target
    got = run(engine(loaded_int8), work)
    assert [got[place] for place in (0, 3, 6)] == alone
    eng = engine(loaded_int8)
    eng.generate([p[:-3] for p, _ in TARGETS], SamplingParams(max_tokens=1))
    outs = eng.generate([p for p, _ in TARGETS], [s for _, s in TARGETS])
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert [result(o) for o in outs] == alone


def test_int8_where_invariance_does_not_reach_warns(tmp_path, caplog, smol_tokenizer):
    """A mixture-of-experts model under int8 loads (not refused, as --batch-invariant would be)
    and the load says its answers may move with the batch and prefix-cache hits."""
    from tests.tiny_models import BACKEND_ARCHS

    make_tiny("qwen3_moe", tmp_path, archs=BACKEND_ARCHS, vocab_size=len(smol_tokenizer))
    smol_tokenizer.save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="batchrun"):
        loaded = llm.load_from_path(tmp_path, EngineConfig.default(quantization="int8"))
    assert not loaded.engine.config.batch_invariant
    assert "not with mixture-of-experts models" in caplog.text
