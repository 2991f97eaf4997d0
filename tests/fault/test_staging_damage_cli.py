"""The issue's case through the CLI: a committed part truncated by 40 bytes, then `batchrun run
--resume`: exit 0, a warning naming the part, and every line of out.jsonl is JSON."""

import json

from tests.helpers import batchrun
from tests.unit.test_batch_resume import STAGING
from tests.unit.test_staging_damage import N, interrupted


def test_truncated_part_then_resume_on_the_cli(tmp_path):
    src, parts, done = interrupted(tmp_path)
    parts[0].write_bytes(parts[0].read_bytes()[:-40])
    proc = batchrun("run", src, "-o", tmp_path / "out.jsonl", "--resume", "--progress", "none",
                    text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"the committed part {parts[0]} is damaged" in proc.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(N)]
    assert not (tmp_path / STAGING).exists()
