"""chat.completion.chunk objects from cumulative engine outputs."""

from openai.types.chat import ChatCompletionChunk

from batchrun.engine.outputs import CompletionOutput, RequestOutput
from batchrun.openai.stream import ChatStream


def out(choices, finished=False, prompt=(1, 2, 3)):
    return RequestOutput("r", list(prompt), choices, finished=finished, num_cached_tokens=2)


def test_role_then_deltas_then_finish_then_usage():
    s = ChatStream("m", include_usage=True)
    chunks = s.start(3)
    chunks += s.update(out([CompletionOutput(0, "Hel", [5])]))
    chunks += s.update(out([CompletionOutput(0, "Hel", [5, 6])]))  # held back: nothing new
    chunks += s.update(out([CompletionOutput(0, "Hello!", [5, 6, 7], "stop")], finished=True))
    chunks += s.end()
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].delta.content for c in parsed[1:3]] == ["Hel", "lo!"]
    assert parsed[2].choices[0].finish_reason == "stop"
    assert parsed[-1].choices == [] and parsed[-1].usage.completion_tokens == 3
    assert parsed[-1].usage.prompt_tokens_details.cached_tokens == 2
    assert len({c.id for c in parsed}) == 1


def test_n_choices_keep_separate_state():
    s = ChatStream("m", n=2, continuous_usage=True)
    chunks = s.start(3)
    chunks += s.update(out([CompletionOutput(1, "b", [9])]))
    chunks += s.update(out([CompletionOutput(0, "a", [8])]))
    chunks += s.update(out([CompletionOutput(1, "bb", [9, 9], "length")]))
    chunks += s.update(out([CompletionOutput(0, "a!", [8, 8], "stop"),
                            CompletionOutput(1, "bb", [9, 9], "length")], finished=True))
    texts = {0: "", 1: ""}
    finishes = {}
    for c in map(ChatCompletionChunk.model_validate, chunks):
        assert c.usage is not None  # continuous_usage_stats
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                assert ch.index not in finishes  # one finish per choice
                finishes[ch.index] = ch.finish_reason
    assert texts == {0: "a!", 1: "bb"} and finishes == {0: "stop", 1: "length"}
    assert s.usage()["completion_tokens"] == 4
