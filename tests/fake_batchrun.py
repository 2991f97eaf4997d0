"""`python -m tests.fake_batchrun ARGS...`: the batchrun CLI with the fake engine's loader
injected (tests/fake_engine.py: no torch, no weights), for fast subprocess tests of exit codes,
signals and files. `BATCHRUN_FAKE_STEP_S` makes every engine step sleep."""

from batchrun.cli import main
from tests.fake_engine import load

if __name__ == "__main__":
    main(obj={"load_model": load})
