"""Image captioning lines on a random-weight Qwen2-VL: batchrun's whole batch path (images
fetched from a loopback HTTP server, rendered, run on the engine) against transformers'
`generate` on left-padded static batches of the same processor output, side by side in one run.

    python benchmarks/vlm_captioning.py                      # 200 lines, 32 tokens each
    python benchmarks/vlm_captioning.py --lines 64 --delay 0.1

Both decode greedily with EOS ignored (min_tokens = max_tokens), so both make the same number
of tokens. With --delay the image server sleeps that long per image; the time the job loop spent
waiting for an image (MediaFetcher.image on a fetch still running) is reported against the run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.scoring import cpu_name  # noqa: E402
from tests.image_server import ImageServer  # noqa: E402

PROMPT = "Write a one-line caption for this product photo."


def build_model(path: Path):
    """A Qwen2-VL of realistic small shape (a 4-layer 512-wide decoder, a 4-block vision tower)
    with the bundled tokenizer; random weights."""
    import transformers as t
    from transformers import AutoTokenizer

    from batchrun.models.resolve import resolve_model
    from tests import tiny_vlms

    base = AutoTokenizer.from_pretrained(resolve_model(None).path)
    tok = tiny_vlms.tokenizer("qwen2_vl", base)
    processor = tiny_vlms.processor("qwen2_vl", tok)
    ids = {n: tok.convert_tokens_to_ids(n) for n in tiny_vlms.EXTRA_TOKENS["qwen2_vl"]}
    text = dict(tiny_vlms.TEXT, vocab_size=len(tok), hidden_size=512, intermediate_size=1408,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                initializer_range=0.02,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [8, 12, 12]})
    cfg = t.Qwen2VLConfig(
        text_config=text,
        vision_config=dict(depth=4, embed_dim=256, hidden_size=512, num_heads=4, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    model = t.Qwen2VLForConditionalGeneration(cfg).eval()
    model.save_pretrained(path)
    tiny_vlms.save_processor(processor, path)
    return model, processor


def images(n: int):
    """n distinct images of a few sizes (so a step mixes image token counts)."""
    sizes = [(112, 84), (84, 112), (140, 112), (112, 112)]
    return [tiny_image(*sizes[i % len(sizes)], seed=i) for i in range(n)]


def tiny_image(w, h, seed):
    from tests.tiny_vlms import image

    return image(w, h, seed)


def run_batchrun(path: Path, base: str, n: int, max_tokens: int, workdir: Path):
    from batchrun.batch.job.runner import run_batch
    from batchrun.llm import load_from_path
    from batchrun.openai import media
    from batchrun.options.engine import EngineConfig
    from tests.helpers import job_plan

    waited = [0.0]
    original = media.MediaFetcher.image

    def timed(self, url):
        t = time.perf_counter()
        try:
            return original(self, url)
        finally:
            waited[0] += time.perf_counter() - t

    media.MediaFetcher.image = timed
    loaded = load_from_path(path, EngineConfig.default(threads=torch.get_num_threads()))
    src = workdir / "in.jsonl"
    with open(src, "w") as f:
        for i in range(n):
            body = {"max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": [
                        {"type": "text", "text": PROMPT},
                        {"type": "image_url", "image_url": {"url": f"{base}/{i}.png"}}]}]}
            f.write(json.dumps({"custom_id": f"c{i}", "method": "POST",
                                "url": "/v1/chat/completions", "body": body}) + "\n")
    plan = job_plan(input=str(src), output=str(workdir / "out.jsonl"), progress="none",
                    ignore_model_field=True)
    t = time.perf_counter()
    run_batch(loaded, plan)
    seconds = time.perf_counter() - t
    media.MediaFetcher.image = original
    out = [json.loads(x) for x in open(workdir / "out.jsonl")]
    tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in out)
    return seconds, tokens, waited[0], len(out)


@torch.inference_mode()
def run_transformers(model, processor, imgs, max_tokens: int, batch: int):
    processor.tokenizer.padding_side = "left"
    msgs = [{"role": "user", "content": [{"type": "text", "text": PROMPT}, {"type": "image"}]}]
    text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    t = time.perf_counter()
    tokens = 0
    for i in range(0, len(imgs), batch):
        chunk = imgs[i:i + batch]
        inputs = processor(text=[text] * len(chunk), images=chunk, return_tensors="pt",
                           padding=True)
        out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False)
        tokens += (out.shape[1] - inputs["input_ids"].shape[1]) * len(chunk)
    return time.perf_counter() - t, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32, help="transformers' static batch size")
    ap.add_argument("--delay", type=float, default=0.1, help="seconds the server takes per image")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="vlm-bench-"))
    model, processor = build_model(workdir / "model")
    imgs = images(args.lines)
    routes = {}
    for i, img in enumerate(imgs):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        routes[f"/{i}.png"] = buf.getvalue()
    server = ImageServer(routes, delay=args.delay)
    base = server.base
    print(f"CPU: {cpu_name()}; torch threads: {torch.get_num_threads()}; {args.lines} lines, "
          f"{args.max_tokens} tokens each; image server delay {args.delay * 1000:.0f} ms")
    b_s, b_tok, waited, done = run_batchrun(workdir / "model", base, args.lines,
                                            args.max_tokens, workdir)
    server.close()
    h_s, h_tok = run_transformers(model, processor, imgs, args.max_tokens, args.batch)
    print(f"batchrun      {b_s:7.1f} s  {b_tok / b_s:7.1f} output tok/s  ({done} lines; "
          f"job loop waited {waited:.2f} s for images = {100 * waited / b_s:.1f}% of the run)")
    print(f"transformers  {h_s:7.1f} s  {h_tok / h_s:7.1f} output tok/s  (static batches of "
          f"{args.batch})")
    print(f"ratio         {(b_tok / b_s) / (h_tok / h_s):.2f}x")


if __name__ == "__main__":
    main()
