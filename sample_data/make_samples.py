"""Regenerate the derived samples from chat.jsonl: `python sample_data/make_samples.py`.

chat.jsonl.gz   the same lines, gzip-compressed
chat.parquet    the OpenAI batch columns (custom_id, method, url, body as a JSON string)
prompts.parquet a flat table: id, question, system, max_tokens, temperature
                (run with --column custom_id=id --column prompt=question)
"""

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).parent


def main() -> None:
    raw = (HERE / "chat.jsonl").read_bytes()
    # mtime=0 keeps the file byte-identical from one regeneration to the next
    (HERE / "chat.jsonl.gz").write_bytes(gzip.compress(raw, mtime=0))
    lines = [json.loads(x) for x in raw.decode().splitlines() if x.strip()]
    pq.write_table(pa.table({
        "custom_id": [x["custom_id"] for x in lines],
        "method": [x["method"] for x in lines],
        "url": [x["url"] for x in lines],
        "body": [json.dumps(x["body"]) for x in lines],
    }), HERE / "chat.parquet")
    questions = ["What is the capital of France?", "Name a primary colour.",
                 "What is 2 + 2?", "Say hello in Spanish.", "What do bees make?",
                 "Which planet is known as the red planet?"]
    pq.write_table(pa.table({
        "id": list(range(1, len(questions) + 1)),
        "question": questions,
        "system": [None, "Answer in one word.", "Answer with a number.", None, None,
                   "Answer in one word."],
        "max_tokens": [24, 8, 8, 16, 16, 8],
        "temperature": [0.0] * len(questions),
    }), HERE / "prompts.parquet")


if __name__ == "__main__":
    main()
