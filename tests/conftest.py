import os
import tempfile

import pytest

# Runs record their metrics for `batchrun plan`'s calibration; runs on the fake engine must not
# calibrate the user's real model. Set before any test (subprocesses inherit it).
os.environ["BATCHRUN_RUNS_DIR"] = tempfile.mkdtemp(prefix="batchrun-test-runs-")

# Without a GPU the Triton kernels run under Triton's interpreter, which triton.jit reads when a
# kernel module is imported: set it before any test imports one.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def real_model():
    """The bundled SmolLM2-135M-Instruct behind a batchrun engine (loaded once per session)."""
    from batchrun import llm

    return llm.load(None)


@pytest.fixture(scope="session")
def hf_real_model(real_model):
    """The same weights through transformers, the reference for greedy parity."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_model.path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The bundled model's real tokenizer, without loading its weights."""
    from transformers import AutoTokenizer

    from batchrun.models.weights.resolve import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None).path)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matrices gain nothing from threads, and on busy shared cores the threads' hand-offs
    made a module of them 20x slower: such a module takes
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_addoption(parser):
    parser.addoption("--matrix", action="store_true",
                     help="also run the full architecture matrices (tests marked `matrix`); the "
                          "default run keeps one representative per mechanism")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--matrix") or "matrix" in (config.getoption("-m") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("matrix") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
