"""Caps on what one request may ask of the engine, named by field."""

import pytest

from batchrun.openai.wire import RequestError, parse_body
from batchrun.openai.requests import MAX_COMPLETION_PROMPTS

URL = "/v1/completions"


def test_a_completions_request_has_at_most_the_documented_number_of_prompts():
    parse_body(URL, {"prompt": ["x"] * MAX_COMPLETION_PROMPTS, "max_tokens": 1})
    with pytest.raises(RequestError) as e:
        parse_body(URL, {"prompt": ["x"] * 10_000, "max_tokens": 1})
    assert e.value.param == "prompt" and "at most 2048 prompts" in e.value.message
    with pytest.raises(RequestError) as e:
        parse_body(URL, {"prompt": [[1, 2]] * (MAX_COMPLETION_PROMPTS + 1), "max_tokens": 1})
    assert e.value.param == "prompt"


def test_one_prompt_of_many_token_ids_is_one_prompt():
    parse_body(URL, {"prompt": list(range(5000)), "max_tokens": 1})
