"""The sampler on synthetic logits: penalties, logit_bias, min_tokens, filters, seeds, logprobs
and the structured-output bitmask."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import jsonschema
import pytest
import torch

from batchrun.engine.penalties import apply_penalties
from batchrun.engine.sampler import Sampler, row_argmax
from batchrun.engine.sampling_params import GrammarSpec, SamplingParams

V = 64
EOS = 2


@dataclass
class Row:
    params: SamplingParams
    all_token_ids: list[int] = field(default_factory=lambda: [10, 11, 12])
    num_prompt_tokens: int = 3
    request_id: str = "r"

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens


def sampler():
    return Sampler(torch.device("cpu"), None, [EOS])


def test_frequency_and_presence_follow_openai_definition():
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    row = Row(p, [10, 11, 3, 3, 5], num_prompt_tokens=2)
    out = apply_penalties(torch.zeros(1, V), [row])[0]
    assert out[3] == pytest.approx(-2 * 0.5 - 0.25)
    assert out[5] == pytest.approx(-0.5 - 0.25)
    assert out[10] == 0 and out[11] == 0  # prompt tokens are not counted
    assert out[4] == 0


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    logits = torch.zeros(1, V)
    logits[0, 10], logits[0, 3], logits[0, 7] = 2.0, -1.0, 2.0
    row = Row(SamplingParams(repetition_penalty=2.0), [10, 11, 3], num_prompt_tokens=2)
    out = apply_penalties(logits, [row])[0]
    assert (out[10], out[3], out[7]) == (1.0, -2.0, 2.0)


def test_penalties_only_touch_rows_that_ask():
    logits = torch.randn(2, V)
    rows = [Row(SamplingParams(frequency_penalty=1.0), [1, 5, 5], 1), Row(SamplingParams(), [1, 5, 5], 1)]
    out = apply_penalties(logits, rows)
    assert torch.equal(out[1], logits[1]) and out[0, 5] == pytest.approx(logits[0, 5] - 2)


def test_greedy_takes_the_penalised_argmax_and_logit_bias():
    logits = torch.zeros(3, V)
    logits[:, 7] = 1.0
    rows = [Row(SamplingParams(temperature=0, frequency_penalty=2.0), [1, 7], 1),
            Row(SamplingParams(temperature=0, logit_bias={9: 100.0})),
            Row(SamplingParams(temperature=0, logit_bias={7: -100.0}))]
    tokens = sampler()(logits, rows).token_ids
    assert tokens[0] != 7 and tokens[1] == 9 and tokens[2] != 7


def test_row_argmax_takes_the_first_of_tied_maxima_as_argmax():
    x = torch.randn(37, 1000, generator=torch.Generator().manual_seed(3))
    x[0, [5, 700]] = 50.0  # a tie: the first index wins
    x[1, :] = 0.0  # a row all tied
    x[2, [999, 998]] = float("inf")
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert row_argmax(x)[:3].tolist() == [5, 0, 998]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(2, V)
    logits[:, EOS] = 10.0
    logits[:, 20] = 9.0
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[20])
    early = Row(p, [1, 4], 1)  # one output token so far
    done = Row(p, [1, 4, 5], 1)  # two
    assert sampler()(logits, [early, done]).token_ids[0] not in (EOS, 20)
    assert sampler()(logits, [early, done]).token_ids[1] == EOS


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=0.01),
                                    SamplingParams(min_p=1.0)])
def test_filters_down_to_one_token_equal_greedy(params):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    got = sampler()(logits, [Row(params)] * 4).token_ids
    assert got == logits.argmax(dim=-1).tolist()


def test_temperature_samples_the_softmax():
    logits = torch.full((4000, V), -1e9)
    logits[:, 0], logits[:, 1] = 0.0, math.log(3.0)  # p = 0.25 / 0.75
    tokens = torch.tensor(sampler()(logits, [Row(SamplingParams())] * 4000).token_ids)
    assert set(tokens.tolist()) == {0, 1}
    assert abs(float((tokens == 1).float().mean()) - 0.75) < 0.03
    hot = torch.tensor(sampler()(logits, [Row(SamplingParams(temperature=2.0))] * 4000).token_ids)
    # T=2: p(1) = sqrt(3) / (1 + sqrt(3)) = 0.634
    assert abs(float((hot == 1).float().mean()) - 0.634) < 0.03


@pytest.mark.parametrize("seeded_params", [SamplingParams(seed=7), SamplingParams(seed=7, top_k=5),
                                           SamplingParams(seed=7, top_p=0.5, min_p=0.01)])
def test_seeded_rows_ignore_their_neighbours(seeded_params):
    gen = torch.Generator().manual_seed(1)
    steps = [torch.randn(5, V, generator=gen) for _ in range(6)]

    def run(rows, pos):
        """The seeded row at `pos` always sees row 0 of each step's logits."""
        s = sampler()
        order = [pos] + [i for i in range(5) if i != pos]
        return [s(logits[torch.tensor(order).argsort()], rows).token_ids[pos] for logits in steps]

    seeded = Row(seeded_params, request_id="a")
    others = [Row(p, request_id=f"o{i}") for i, p in enumerate([
        SamplingParams(), SamplingParams(top_k=10), SamplingParams(top_p=0.7),
        SamplingParams(temperature=0)])]
    alone = run([seeded] * 1 + others, 0)
    assert run(others[:2] + [seeded] + others[2:], 2) == alone
    other_seed = run([Row(dataclasses.replace(seeded_params, seed=8), request_id="a")] + others, 0)
    assert other_seed != alone


def test_logprobs_are_the_raw_model_distribution():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    rows = [Row(SamplingParams(temperature=0, logprobs=3, frequency_penalty=1.0)),
            Row(SamplingParams(temperature=0))]
    out = sampler()(logits, rows)
    ref = torch.log_softmax(logits[0], dim=-1)
    lp, top = out.logprobs[0]
    assert lp == pytest.approx(float(ref[out.token_ids[0]]))
    assert [t for t, _ in top] == ref.topk(3).indices.tolist()
    assert [v for _, v in top] == pytest.approx(ref.topk(3).values.tolist())
    assert out.logprobs[1] is None


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def decode_loop(s, tokenizer, rows, logits_fn, steps=150):
    """Run the sampler like the engine does; returns each row's text once it emits EOS."""
    done = {}
    for _ in range(steps):
        live = [r for r in rows if r.request_id not in done]
        if not live:
            break
        out = s(logits_fn(len(live)), live)
        for r, t in zip(live, out.token_ids):
            s.accept(r, t)
            if t == EOS:
                done[r.request_id] = tokenizer.decode(r.all_token_ids[r.num_prompt_tokens:])
            r.all_token_ids.append(t)
    return done


def test_grammar_bitmask_forces_schema_valid_json_from_random_logits(smol_tokenizer):
    tok = smol_tokenizer
    vocab = len(tok)
    s = Sampler(torch.device("cpu"), tok, [EOS])
    gen = torch.Generator().manual_seed(0)
    spec = GrammarSpec(json_schema=SCHEMA)
    rows = [Row(SamplingParams(temperature=1.0, grammar=spec, seed=i), [1, 5], 2, f"j{i}")
            for i in range(4)]
    rows.append(Row(SamplingParams(temperature=0, grammar=GrammarSpec(regex=r"(yes|no)")),
                    [1, 5], 2, "re"))
    free = Row(SamplingParams(temperature=1.0, max_tokens=5), [1, 5], 2, "free")
    # Random logits with EOS made unlikely, so only the grammar can end a row.
    def logits_fn(n):
        x = torch.randn(n, vocab + 17, generator=gen) * 3  # a padded model vocabulary
        x[:, EOS] = -20
        return x
    texts = decode_loop(s, tok, rows + [free], logits_fn, steps=120)
    for i in range(4):
        obj = json.loads(texts[f"j{i}"])
        jsonschema.validate(obj, SCHEMA)
    assert texts["re"] in ("yes", "no")
    assert "free" not in texts  # unconstrained rows are left alone (EOS is at -20)


def test_grammar_wins_over_min_tokens_once_complete(smol_tokenizer):
    s = Sampler(torch.device("cpu"), smol_tokenizer, [EOS])
    row = Row(SamplingParams(temperature=0, min_tokens=50, grammar=GrammarSpec(regex="ok")),
              [1, 5], 2, "g")
    texts = decode_loop(s, smol_tokenizer, [row], lambda n: torch.zeros(n, len(smol_tokenizer)),
                        steps=10)
    assert texts == {"g": "ok"}


def test_top_p_keeps_the_smallest_set_reaching_p_on_large_vocabularies():
    big = 4096  # more than TOP_P_CANDIDATES: the candidate path
    logits = torch.full((4000, big), -1e9)
    logits[:, :4] = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    tokens = torch.tensor(sampler()(logits, [Row(SamplingParams(top_p=0.8))] * 4000).token_ids)
    assert set(tokens.tolist()) == {0, 1}  # mass before token 2 is already 0.8
    assert abs(float((tokens == 0).float().mean()) - 0.625) < 0.03
    both = torch.tensor(sampler()(logits, [Row(SamplingParams(top_p=0.8, top_k=3))] * 4000)
                        .token_ids)
    assert set(both.tolist()) == {0, 1}
    # A flat distribution: the best 1024 hold a quarter of the mass, so all tokens are in play.
    flat = torch.zeros((2000, big))
    spread = torch.tensor(sampler()(flat, [Row(SamplingParams(top_p=0.9))] * 2000).token_ids)
    assert int(spread.max()) > 1024 and len(set(spread.tolist())) > 1000
