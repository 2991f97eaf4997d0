"""Image captioning lines on a random-weight vision-language model of realistic small size:
batchrun's whole batch path (images fetched from a loopback HTTP server, rendered, run on the
engine) against transformers' `generate` on left-padded static batches of the same processor
output, side by side in one run (--repeats runs of each, interleaved; medians).

    python benchmarks/vlm_captioning.py                    # SmolVLM-256M-like, 200 lines, 3 repeats
    python benchmarks/vlm_captioning.py --family qwen2_vl --lines 64 --repeats 1

Models (random weights, the bundled tokenizer plus the family's image tokens):
- smolvlm: SmolVLM-256M's decoder as it ships (SmolLM2-135M's shape: 30 layers, 576 wide, 9
  heads / 3 KV heads, MLP 1536), a SigLIP-shaped tower cut to 4 layers of 384 on 256-px images
  (16-px patches, pixel shuffle 2: 64 image tokens per image, as SmolVLM's 512-px tiles give).
- qwen2_vl: Qwen2-VL with a 24-layer 768-wide decoder (~150M without embeddings) and a 4-block
  vision tower; images of a few sizes give 12-64 image tokens each.
The vision towers are cut down because on a shared 2-core machine a full SigLIP-base costs
seconds per image in both systems alike (the same transformers module runs in each).

Caption lengths vary per line as real captions do: max_tokens drawn per line from a seeded
distribution over 16..96, forced with min_tokens (random weights never say EOS), the same for
both systems; a static batch runs to its longest line as `generate` does (the extra tokens of
its shorter lines are padding after EOS, not counted). Both decode greedily. The image server
sleeps --delay per image; the time the job loop waited for an image (MediaFetcher.image on a
fetch still running) is reported against batchrun's run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.scoring import cpu_name  # noqa: E402
from tests.image_server import ImageServer  # noqa: E402

PROMPT = "Write a one-line caption for this product photo."
SIZES = [(320, 240), (240, 320), (400, 300), (256, 256)]  # (width, height) cycled over the lines


def smolvlm_config(tok, ids):
    import transformers as t

    text = dict(vocab_size=len(tok), hidden_size=576, intermediate_size=1536,
                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                initializer_range=0.02, tie_word_embeddings=True, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, model_type="llama")
    vision = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=4,
                  num_attention_heads=6, image_size=256, patch_size=16)
    return t.SmolVLMConfig(text_config=text, vision_config=vision, scale_factor=2,
                           image_token_id=ids["<image>"], tie_word_embeddings=True)


def smolvlm_processor(tok):
    import transformers as t

    from batchrun.models.transformers.processor import images_only

    ip = t.SmolVLMImageProcessorPil(size={"longest_edge": 256},
                                    max_image_size={"longest_edge": 256},
                                    do_image_splitting=False)
    return images_only(t.SmolVLMProcessor)(image_processor=ip, tokenizer=tok, image_seq_len=64,
                                           chat_template=tok.chat_template, video_processor=None)


def qwen2_vl_config(tok, ids):
    import transformers as t

    from tests import tiny_vlms

    text = dict(tiny_vlms.TEXT, vocab_size=len(tok), hidden_size=768, intermediate_size=2048,
                num_hidden_layers=24, num_attention_heads=12, num_key_value_heads=4,
                initializer_range=0.02,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [8, 12, 12]})
    return t.Qwen2VLConfig(
        text_config=text,
        vision_config=dict(depth=4, embed_dim=256, hidden_size=768, num_heads=4, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def build_model(family: str, path: Path):
    """The family's model (random weights) and processor, saved to `path`."""
    import transformers as t
    from transformers import AutoTokenizer

    from batchrun.models.weights.resolve import resolve_model
    from tests import tiny_vlms

    base = AutoTokenizer.from_pretrained(resolve_model(None).path)
    tok = tiny_vlms.tokenizer(family, base)
    ids = {n: tok.convert_tokens_to_ids(n) for n in tiny_vlms.EXTRA_TOKENS[family]}
    if family == "smolvlm":
        processor, cfg = smolvlm_processor(tok), smolvlm_config(tok, ids)
    else:
        processor, cfg = tiny_vlms.processor(family, tok), qwen2_vl_config(tok, ids)
    torch.manual_seed(0)
    model = t.AutoModelForImageTextToText.from_config(cfg).eval()
    model.save_pretrained(path)
    tiny_vlms.save_processor(processor, path)
    tower = [p.numel() for n, p in model.named_parameters() if "vision" in n or "visual" in n]
    return model, processor, (model.num_parameters() - sum(tower), sum(tower))


def caption_lengths(n: int, seed: int = 0) -> list[int]:
    """Per-line max_tokens in 16..96, skewed short as captions are (a seeded draw)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.gamma(4.0, 10.0, n) + 8, 16, 96)]


def write_input(path: Path, base: str, lengths: list[int]) -> None:
    with open(path, "w") as f:
        for i, n in enumerate(lengths):
            body = {"max_tokens": n, "min_tokens": n, "temperature": 0,
                    "messages": [{"role": "user", "content": [
                        {"type": "text", "text": PROMPT},
                        {"type": "image_url", "image_url": {"url": f"{base}/{i}.png"}}]}]}
            f.write(json.dumps({"custom_id": f"c{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")


class ImageWait:
    """Time the job loop spends in MediaFetcher.image (waiting on a fetch still running)."""

    def __enter__(self):
        from batchrun.openai import media

        self.media, self.original, self.seconds = media, media.MediaFetcher.image, 0.0
        original = self.original

        def timed(fetcher, url):
            t = time.perf_counter()
            try:
                return original(fetcher, url)
            finally:
                self.seconds += time.perf_counter() - t

        media.MediaFetcher.image = timed
        return self

    def __exit__(self, *exc):
        self.media.MediaFetcher.image = self.original


def run_batchrun(loaded, src: Path, out: Path):
    from batchrun.batch.job.runner import run_batch
    from tests.helpers import job_plan

    if out.exists():
        out.unlink()
    plan = job_plan(input=str(src), output=str(out), progress="none", ignore_model_field=True,
                    allow_media_host=["127.0.0.1"])  # the loopback image server, opted in
    with ImageWait() as wait:
        t = time.perf_counter()
        run_batch(loaded, plan)
        seconds = time.perf_counter() - t
    records = [json.loads(x) for x in open(out)]
    tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in records)
    return seconds, tokens, wait.seconds


@torch.inference_mode()
def run_transformers(model, processor, imgs, lengths: list[int], batch: int):
    processor.tokenizer.padding_side = "left"
    msgs = [{"role": "user", "content": [{"type": "text", "text": PROMPT}, {"type": "image"}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    t = time.perf_counter()
    for i in range(0, len(imgs), batch):
        chunk = imgs[i:i + batch]
        inputs = processor(text=[text] * len(chunk), images=[[im] for im in chunk],
                           return_tensors="pt", padding=True)
        longest = max(lengths[i:i + batch])  # generate runs the batch to its longest line
        model.generate(**inputs, max_new_tokens=longest, min_new_tokens=longest, do_sample=False)
    return time.perf_counter() - t, sum(lengths)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", choices=("smolvlm", "qwen2_vl"), default="smolvlm")
    ap.add_argument("--lines", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32, help="transformers' static batch size")
    ap.add_argument("--delay", type=float, default=0.1, help="seconds the server takes per image")
    args = ap.parse_args()
    from batchrun.llm import load_from_path
    from batchrun.options.engine import EngineConfig
    from tests.tiny_vlms import image

    workdir = Path(tempfile.mkdtemp(prefix="vlm-bench-"))
    model, processor, (decoder, vision) = build_model(args.family, workdir / "model")
    imgs = [image(*SIZES[i % len(SIZES)], seed=i) for i in range(args.lines)]
    lengths = caption_lengths(args.lines)
    routes = {}
    for i, img in enumerate(imgs):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        routes[f"/{i}.png"] = buf.getvalue()
    server = ImageServer(routes, delay=args.delay)
    write_input(workdir / "in.jsonl", server.base, lengths)
    loaded = load_from_path(workdir / "model",
                            EngineConfig.default(threads=torch.get_num_threads()))
    print(f"CPU: {cpu_name()}; torch threads: {torch.get_num_threads()}; load average "
          f"{os.getloadavg()[0]:.2f} at start")
    print(f"{args.family}: decoder {decoder / 1e6:.0f}M params (embeddings and connector "
          f"included), vision "
          f"{vision / 1e6:.0f}M; {args.lines} lines, max_tokens 16..96 per line (mean "
          f"{statistics.mean(lengths):.0f}), image server delay {args.delay * 1000:.0f} ms")
    ours, theirs, waits = [], [], []
    for r in range(args.repeats):
        b_s, b_tok, waited = run_batchrun(loaded, workdir / "in.jsonl", workdir / "out.jsonl")
        assert b_tok == sum(lengths), (b_tok, sum(lengths))
        h_s, _ = run_transformers(model, processor, imgs, lengths, args.batch)
        ours.append(b_s)
        theirs.append(h_s)
        waits.append(waited / b_s)
        print(f"repeat {r + 1}: batchrun {b_s:6.1f} s (waited {waited:.2f} s for images), "
              f"transformers {h_s:6.1f} s, ratio {h_s / b_s:.2f}x, load average "
              f"{os.getloadavg()[0]:.2f}")
    server.close()
    b_s, h_s = statistics.median(ours), statistics.median(theirs)
    print(f"batchrun      {b_s:7.1f} s  {sum(lengths) / b_s:7.1f} output tok/s  (median of "
          f"{args.repeats}; job loop waited for images {100 * statistics.median(waits):.1f}% "
          f"of the run)")
    print(f"transformers  {h_s:7.1f} s  {sum(lengths) / h_s:7.1f} output tok/s  (static "
          f"batches of {args.batch}, each to its longest line)")
    print(f"ratio         {h_s / b_s:.2f}x (median of per-system medians); per repeat: "
          f"{', '.join(f'{h / b:.2f}x' for h, b in zip(theirs, ours))}")


if __name__ == "__main__":
    main()
