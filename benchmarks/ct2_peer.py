"""CTranslate2 as a bench peer: the model's safetensors folder converted once with
ctranslate2's TransformersConverter, then `Generator.generate_batch` on the bench's token ids
(greedy, batches of 32, each request cut at its max_tokens and at EOS, EOS counted).

ctranslate2 is in the `bench` extra (pyproject.toml); it quantises float32 weights to int8 when
the Generator loads with compute_type="int8", so one float32 conversion serves both systems.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from batchrun.paths import cache_dir
from benchmarks.results import Result, trim

# bench system name -> CTranslate2 compute_type (bfloat16 is GPU-only in CTranslate2)
SYSTEMS = {"ct2-int8": "int8", "ct2-float32": "float32"}


def converted(folder: Path) -> Path:
    """The CTranslate2 conversion of a Hugging Face folder, built once into the cache."""
    target = cache_dir() / "ct2" / Path(folder).name
    if (target / "model.bin").is_file():
        return target
    import ctranslate2.converters

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        converter = ctranslate2.converters.TransformersConverter(str(folder))
        converter.convert(str(tmp / "m"), force=True)
        os.replace(tmp / "m", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def run_ct2(system: str, folder: Path, tokenizer, prompts: list[list[int]],
            max_tokens: list[int], eos_id: int, threads: int, batch_size: int = 32) -> Result:
    """Greedy generation of every prompt with CTranslate2 at SYSTEMS[system]'s compute type."""
    import ctranslate2

    generator = ctranslate2.Generator(str(converted(folder)), device="cpu",
                                      compute_type=SYSTEMS[system], inter_threads=1,
                                      intra_threads=threads)
    tokens = [tokenizer.convert_ids_to_tokens(p) for p in prompts]
    start = time.perf_counter()
    # max_batch_size sorts the requests by length into batches of 32 (CTranslate2's own way
    # to cut padding); the prompt is forwarded at once to fill the KV cache.
    results = generator.generate_batch(tokens, max_batch_size=batch_size, beam_size=1,
                                       max_length=max(max_tokens), end_token=[eos_id],
                                       return_end_token=True, include_prompt_in_result=False)
    seconds = time.perf_counter() - start
    outputs = [trim(r.sequences_ids[0], m, eos_id) for r, m in zip(results, max_tokens)]
    return Result(system, seconds, sum(map(len, prompts)), sum(map(len, outputs)), outputs)
