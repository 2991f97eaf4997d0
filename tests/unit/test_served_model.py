"""The ServedModel Protocol (batchrun/served_model.py) against what implements it: the local
LoadedModel, the driver side of a Ray run (RayModel), the tokenizer-only TokenizerModel and the
tests' FakeModel. A member an implementation lacks fails here, not in the middle of a request."""

from types import SimpleNamespace

import pytest

from batchrun.distributed.client import RayModel
from batchrun.llm import LoadedModel
from batchrun.openai.serving import OpenAIServing
from batchrun.options.engine import EngineConfig
from batchrun.served_model import ServedModel, TokenizerModel, system_fingerprint
from tests.fake_engine import FakeTokenizer, fake_model
from tests.helpers import tiny_engine


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    _, engine = tiny_engine("llama", path, num_blocks=16)
    return LoadedModel(engine, engine.tokenizer, "tiny", ("tiny-alias",), {"top_k": 5}, path)


def on_ray(config: EngineConfig, name: str) -> RayModel:
    """A RayModel on a stand-in for the client over the replicas (its name, context length and
    config are what RayModel reads; the replicas are not needed)."""
    client = SimpleNamespace(name=name, max_model_len=512, config=config)
    return RayModel(client, TokenizerModel(FakeTokenizer(), name, ("alias",)))


def test_the_protocol_lists_what_callers_use():
    members = {n for n in vars(ServedModel) if not n.startswith("_")}
    assert set(ServedModel.__annotations__) | members >= {
        "name", "aliases", "tokenizer", "max_model_len", "generation_defaults", "adapters",
        "path", "engine", "engine_config", "eos_token_ids", "hidden_size", "fingerprint"}


def test_each_implementation_is_a_served_model(local):
    models = [local, on_ray(local.engine.config, "tiny"), TokenizerModel(FakeTokenizer(), "t"),
              fake_model()]
    for model in models:
        assert isinstance(model, ServedModel), type(model).__name__
        OpenAIServing(model)  # the adapter asks only for what the protocol lists


def test_the_local_model_answers_from_its_engine(local):
    assert local.hidden_size == 128  # tests/tiny_models.py
    assert local.eos_token_ids == tuple(sorted(local.engine.eos_token_ids))
    assert local.engine_config is local.engine.config
    assert local.max_model_len == local.engine.max_model_len


def test_fingerprint_is_the_name_version_and_engine_config(local):
    assert local.fingerprint == system_fingerprint("tiny", local.engine.config)
    assert local.fingerprint.startswith("fp_") and len(local.fingerprint) == 15
    # The same model and engine configuration answer with the same fingerprint on Ray.
    assert on_ray(local.engine.config, "tiny").fingerprint == local.fingerprint
    assert on_ray(local.engine.config, "other").fingerprint != local.fingerprint
    other_config = local.engine.config.model_copy(update={"max_model_len": 99})
    assert on_ray(other_config, "tiny").fingerprint != local.fingerprint
    # A tokenizer-only model has no engine configuration.
    assert TokenizerModel(FakeTokenizer(), "tiny").fingerprint == system_fingerprint("tiny", None)
