"""A batch's usage sums its records' usage, whichever endpoint's shape they have."""

from openai.types import BatchUsage

from batchrun.openai.batch_usage import batch_usage


def record(usage):
    return {"id": "r", "custom_id": "c", "response": {"status_code": 200, "body": {"usage": usage}}}


def test_usage_of_every_endpoint_adds_up():
    records = [
        record({"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                "prompt_tokens_details": {"cached_tokens": 3},
                "completion_tokens_details": {"reasoning_tokens": 2}}),  # chat
        record({"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                "prompt_tokens_details": {"cached_tokens": 0}}),  # completions
        record({"prompt_tokens": 7, "total_tokens": 7}),  # embeddings
        record({"input_tokens": 9, "output_tokens": 6, "total_tokens": 15,
                "input_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 5}}),  # responses
        {"id": "e", "custom_id": "x", "response": None, "error": {"code": "x"}},  # no body
        record(None),
    ]
    usage = BatchUsage.model_validate(batch_usage(records))
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (31, 11, 42)
    assert usage.input_tokens_details.cached_tokens == 11
    assert usage.output_tokens_details.reasoning_tokens == 7


def test_an_empty_batch_has_zero_usage():
    usage = BatchUsage.model_validate(batch_usage([]))
    assert usage.total_tokens == 0 and usage.input_tokens_details.cached_tokens == 0
