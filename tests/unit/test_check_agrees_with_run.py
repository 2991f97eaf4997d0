"""`batchrun models check FOLDER` says what `run` does with the folder: the path it loads on
(native file, or the transformers backend) and the KV shape the load finds, or the refusal
run gives, word for word; for every architecture of the tiny parity tables (tests/tiny_models.py
ARCHS, BACKEND_ARCHS and STATE_ARCHS, tests/tiny_vlms.py, tests/tiny_vlm_families.py) and a
few that run refuses."""

import re

import pytest
import torch

from batchrun.llm import load_from_path, load_weights
from batchrun.models.transformers.model import TransformersModel
from batchrun.options.engine import EngineConfig
from tests.helpers import matrix
from tests.tiny_models import ARCHS, BACKEND_ARCHS, STATE_ARCHS, make_tiny
from tests import tiny_vlm_families
from tests.tiny_vlms import FAMILIES, make_tiny_vlm

CPU = torch.device("cpu")
# BACKEND_ARCHS repeats some of ARCHS under their names: those once
TEXT = [("native", a) for a in sorted(ARCHS)] + \
    [("backend", a) for a in sorted(BACKEND_ARCHS) if BACKEND_ARCHS[a] is not ARCHS.get(a)] + \
    [("state", a) for a in sorted(STATE_ARCHS)]
TABLES = {"native": ARCHS, "backend": BACKEND_ARCHS, "state": STATE_ARCHS}


pytestmark = pytest.mark.usefixtures("one_torch_thread")
# check against run for one architecture per path and mechanism (pytest --matrix: all).
CHECK_KEEP = {"llama", "tied", "gemma2", "bloom", "falcon", "diffllama", "llama4_text", "mixtral",
              "deepseek_v2", "trocr", "mamba", "jamba", "lfm2"}


def models_check(folder):
    """(exit code, path line's kind, its reason, (layers, KV heads, head dim) or None, output)."""
    from click.testing import CliRunner

    from batchrun.models_cli import models

    result = CliRunner().invoke(models, ["check", str(folder)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    path = re.search(r"^path: (native \(models/arch/(\S+)\)|transformers backend|refused) \((.*)\)$",
                     result.output, re.M)
    assert path, result.output
    kind = path[2] or path[1]
    kv = re.search(r"KV cache: (\d+) layers x (\d+) KV heads x (?:head dim (\d+)|K/V head dims "
                   r"(\d+)/(\d+))", result.output)
    shape = None if kv is None else (int(kv[1]), int(kv[2]),
                                     int(kv[3] or max(int(kv[4]), int(kv[5]))))
    return result.exit_code, kind, path[3], shape, result.output


def run_verdict(folder, load=load_weights):
    """What run does with the folder: (kind as check names it, (layers, KV heads, head dim)),
    or ("refused", the reason)."""
    try:
        model = load(folder, EngineConfig.default(), CPU, torch.float32) if load is load_weights \
            else load(folder).engine.runner.model
    except ValueError as exc:  # UnsupportedModelError, a refusal
        return "refused", str(exc)
    cfg = model.config
    kind = "transformers backend" if isinstance(model, TransformersModel) \
        else type(model).__module__.rsplit(".", 1)[-1] + ".py"
    if not cfg.num_layers:  # no attention layer (Mamba): check says "KV cache: none"
        return kind, None
    return kind, (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)


def assert_agree(folder, load=load_weights):
    code, kind, reason, shape, output = models_check(folder)
    ran = run_verdict(folder, load)
    if kind == "refused":
        assert code == 2 and ran == ("refused", reason), output
    else:
        assert code == 0 and ran == (kind, shape), output
    return output


@pytest.mark.parametrize("table,arch", matrix(TEXT, CHECK_KEEP, key=lambda v: v[1]))
def test_check_says_what_run_does_for_each_text_architecture(table, arch, tmp_path):
    make_tiny(arch, tmp_path, archs=TABLES[table])
    assert_agree(tmp_path)


VISION = {**{f: make_tiny_vlm for f in FAMILIES},
          **{f: tiny_vlm_families.make_tiny_vlm for f in tiny_vlm_families.FAMILIES}}


@pytest.mark.parametrize("family", sorted(VISION))
def test_check_says_what_run_does_for_each_vision_family(family, tmp_path, smol_tokenizer):
    VISION[family](family, tmp_path, smol_tokenizer)
    output = assert_agree(tmp_path)
    assert re.search(r"^  images: yes \(\w+Processor;", output, re.M), output


def test_a_vision_language_folder_without_a_processor_runs_as_a_text_model(tmp_path,
                                                                          smol_tokenizer):
    """A Gemma3ForConditionalGeneration saved with its tokenizer only: run serves it on text
    (greedy as transformers'), and check says it takes no images, and why."""
    from batchrun.engine import SamplingParams

    hf, _ = make_tiny_vlm("gemma3", tmp_path, smol_tokenizer)
    for name in ("processor_config.json", "preprocessor_config.json"):
        (tmp_path / name).unlink()
    output = assert_agree(tmp_path, load_from_path)
    assert "images: no: no processor saved with the model" in output
    loaded = load_from_path(tmp_path)
    assert loaded.processor is None
    prompt = [5, 17, 300, 4000, 9]
    out = loaded.engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                          ignore_eos=True))[0]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                      min_new_tokens=8)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == ref


def test_refusals_are_the_ones_run_gives(tmp_path):
    """A recurrent model the backend does not run (RWKV, by its config), a bidirectional encoder and layers of two KV shapes
    (Gemma 4's, at the load's probe): check refuses each with run's reason, exit code 2."""
    import transformers as t

    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    t.RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1).save_pretrained(tmp_path / "m")
    torch.manual_seed(0)
    t.BertLMHeadModel(t.BertConfig(**{k: v for k, v in text.items() if k != "num_key_value_heads"})
                      ).save_pretrained(tmp_path / "bert")
    t.Gemma4ForConditionalGeneration(t.Gemma4Config(text_config=dict(text, head_dim=16))
                                     ).save_pretrained(tmp_path / "gemma4")
    for name, why in (("m", "keeps a recurrent"), ("bert", "attends bidirectionally")):
        assert why in assert_agree(tmp_path / name), name
    # Gemma 4's layers of two head widths share one KV cache (attention.fit_cache): both run it
    assert "transformers backend" in assert_agree(tmp_path / "gemma4")


def test_a_vision_folder_whose_processor_cannot_load_is_refused_by_both(tmp_path, smol_tokenizer):
    """A processor_config.json naming a processor transformers does not have: run cannot load
    the model (it would take images), and check refuses it in run's words."""
    import json

    make_tiny_vlm("llava", tmp_path, smol_tokenizer)
    settings = json.loads((tmp_path / "processor_config.json").read_text())
    settings["processor_class"] = "NoSuchProcessor"
    (tmp_path / "processor_config.json").write_text(json.dumps(settings))
    output = assert_agree(tmp_path)
    assert "transformers cannot read its processor" in output, output
