"""The batch glue's validating stage on input files with odd lines."""

import json

from batchrun.server.batch_job import validate_input


def test_validation_counts_odd_lines_and_flags_only_wrong_urls(tmp_path):
    path = tmp_path / "in.jsonl"
    deep = b'{"url": ' + b"[" * 20000 + b"]" * 20000 + b"}"
    path.write_bytes(b"\n".join([
        json.dumps({"custom_id": "a", "url": "/v1/chat/completions"}).encode(),
        deep, b"{not json", b"[1]", b"", b"\xff\xfe",
        json.dumps({"custom_id": "b", "url": "/v1/embeddings"}).encode()]) + b"\n")
    total, errors = validate_input(path, "/v1/chat/completions")
    assert total == 6
    assert [(e["code"], e["line"]) for e in errors] == [("invalid_url", 7)]
