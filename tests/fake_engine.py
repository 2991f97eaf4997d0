"""A fake engine with the real one's API (batchrun.engine.client.EngineClient): deterministic, instant, finishes requests out of order.

Used by the batch runner's unit tests, and by CLI subprocess tests (fault injection) through
`python -m tests.fake_batchrun` (its loader injected), so they run without torch or model weights.
`BATCHRUN_FAKE_STEP_S` makes every step sleep (so a kill lands mid-run).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from batchrun.engine.client import EngineStats
from batchrun.engine.errors import PromptTooLongError
from batchrun.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchrun.served_model import system_fingerprint


class FakeTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False,
                            return_dict=False, **kwargs):
        text = "".join(f"{m['role']}:{m['content']}\n" for m in messages) + "assistant:"
        return {"input_ids": [ord(c) % 256 for c in text]} if tokenize else text


class FakeEngine:
    """A request finishes after max_tokens steps, so short requests overtake long ones."""

    max_model_len = 400

    def __init__(self, fail_on_step=None, step_s=0.0, record=True, slow_after=None,
                 slow_step_s=0.0):
        self.running = {}
        self.added = []
        self.aborted = []
        self.peak_in_flight = 0
        self.steps = 0
        self.added_when_finished = {}  # request_id -> how many requests had been added by then
        self.fail_on_step = fail_on_step
        self.step_s = step_s
        # After `slow_after` steps every step takes slow_step_s: a run that finishes some lines
        # at once and then hardly moves, however fast the machine.
        self.slow_after, self.slow_step_s = slow_after, slow_step_s
        self.stats = EngineStats()
        self.record = record  # keep what was added (tests look); off for long runs

    def add_request(self, request_id, prompt_token_ids, params, arrival_time=None, stream=False,
                    priority=None, multimodal=None):
        if multimodal is not None:
            raise ValueError("this model takes text only; the request has images")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLongError("prompt too long")
        if self.record:
            self.added.append((request_id, list(prompt_token_ids), params))
        self.running[request_id] = [list(prompt_token_ids), params, 0, float(self.steps)]
        self.peak_in_flight = max(self.peak_in_flight, len(self.running))

    def step(self):
        self.steps += 1
        self.stats.steps = self.steps
        if self.step_s:
            time.sleep(self.step_s)
        if self.slow_after is not None and self.steps > self.slow_after:
            time.sleep(self.slow_step_s)
        if self.fail_on_step == self.steps:
            raise RuntimeError("engine blew up")
        done = []
        for rid, state in list(self.running.items()):
            state[2] += 1
            prompt, params, generated, arrival = state
            if generated >= params.max_tokens:
                del self.running[rid]
                if self.record:
                    self.added_when_finished[rid] = len(self.added)
                text = bytes(t % 256 for t in prompt).decode("latin-1")
                error = "too big for the KV cache" if "KVFAIL" in text else None
                self.stats.requests_finished += 1
                self.stats.prompt_tokens += len(prompt)
                self.stats.cached_tokens += 2
                self.stats.generation_tokens += generated
                done.append(RequestOutput(
                    rid, prompt, [CompletionOutput(0, f"echo {len(prompt)}", [7] * generated,
                                                   "length")],
                    finished=True, num_cached_tokens=2, error=error,
                    metrics=RequestMetrics(arrival, first_token_time=arrival + 1.0)))
        return done

    def has_unfinished_requests(self):
        return bool(self.running)

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        self.running.pop(request_id, None)


@dataclass
class FakeModel:
    """A batchrun.served_model.ServedModel around a fake (or scripted) engine."""

    engine: Any
    tokenizer: Any
    name: str
    aliases: tuple[str, ...] = ("fm",)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    adapters: tuple[str, ...] = ()
    path: None = None
    engine_config: None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_size: int | None = None
    processor: Any = None  # text only

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def fingerprint(self) -> str:
        return system_fingerprint(self.name, self.engine_config)


def fake_model(engine=None, name="fake-model"):
    """What batchrun.llm.load returns, around a fake engine (no torch needed)."""
    return FakeModel(engine or FakeEngine(), FakeTokenizer(), name)


def load(model, engine_config):
    """The CLI's model loader, for tests/fake_batchrun.py: serves the name asked for (default:
    the bundled model's), so files written for the real model run unchanged."""
    engine = FakeEngine(step_s=float(os.environ.get("BATCHRUN_FAKE_STEP_S", "0")), record=False)
    return fake_model(engine, name=model or "smollm2-135m")
