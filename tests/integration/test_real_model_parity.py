"""Greedy output of batchrun's engine on the bundled model against transformers' generate."""

import torch

from batchrun.engine import SamplingParams
from tests.integration.prompts import PARITY_CHATS, encode
from tests.parity import ParityReport, assert_greedy_match

MAX_NEW = 32
EOS = 2  # the bundled model's <|im_end|>, also its pad token here


def test_greedy_parity_with_hf_generate(real_model, hf_real_model):
    tok = real_model.tokenizer
    prompts = [encode(tok, chat) for chat in PARITY_CHATS]
    outs = real_model.engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    # the reference: one left-padded batch (the padding masked out, positions from the mask;
    # a batch's own float noise is what the tie rule is for)
    width = max(map(len, prompts))
    ids = torch.tensor([[EOS] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ref = hf_real_model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=EOS,
                                 eos_token_id=EOS)
    report = ParityReport()
    for i, out in enumerate(outs):
        ref_ids = ref.sequences[i, width:].tolist()
        if EOS in ref_ids:  # a finished row is padded to the batch's length
            ref_ids = ref_ids[:ref_ids.index(EOS) + 1]
        assert_greedy_match(out.outputs[0].token_ids, ref_ids, [l[i] for l in ref.logits],
                            f"prompt {i}", report)
    print(f"\ngreedy parity: {report.compared} prompts, {report.ties} needed the tie rule "
          f"{report.tie_positions}")
    assert report.compared >= 20
    assert real_model.engine.kv.num_free_blocks == real_model.engine.kv.num_blocks


def test_batch_invariance(real_model):
    """A request gives the same greedy tokens alone and inside 32 mixed-length requests."""
    tok = real_model.tokenizer
    engine = real_model.engine
    prompts = [encode(tok, chat) for chat in PARITY_CHATS]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    target = prompts[7]
    alone = engine.generate([target], params)[0].outputs[0]
    filler = [prompts[i % len(prompts)][: 10 + 7 * i] for i in range(31)]
    batch = filler[:13] + [target] + filler[13:]
    lengths = {len(p) for p in batch}
    assert len(batch) == 32 and len(lengths) > 10
    mixed = engine.generate(batch, params)[13].outputs[0]
    margins = [lp.top[0][1] - lp.top[1][1] for lp in alone.logprobs]
    assert_greedy_match(mixed.token_ids, alone.token_ids, margins, "batch invariance")
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
