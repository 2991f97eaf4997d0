"""State files the server reads at startup: a corrupt one is moved aside, the rest are served."""

import json
import logging

import pytest

from batchrun.server.batches import BatchManager
from batchrun.server.errors import APIError
from batchrun.server.files import FileStore


def batch(batch_id, status="completed", created_at=1):
    return {"id": batch_id, "object": "batch", "status": status, "endpoint": "/v1/chat/completions",
            "input_file_id": "file-in", "created_at": created_at, "in_progress_at": None,
            "request_counts": {"total": 1, "completed": 1, "failed": 0}}


def file_object(file_id):
    return {"id": file_id, "object": "file", "bytes": 3, "created_at": 1, "filename": "in.jsonl",
            "purpose": "batch"}


def test_corrupt_batch_objects_are_quarantined_and_the_rest_load(tmp_path, caplog):
    root = tmp_path / "batches"
    root.mkdir()
    good = json.dumps(batch("batch_good"))
    (root / "batch_good.json").write_text(good)
    bad = {"batch_truncated": good[: len(good) // 2], "batch_list": "[1, 2]",
           "batch_noid": json.dumps({k: v for k, v in batch("x").items() if k != "id"}),
           "batch_status": json.dumps(batch("batch_status", status="exploded")),
           "batch_counts": json.dumps({**batch("batch_counts"), "request_counts": [1]}),
           "batch_other": json.dumps(batch("batch_good")),  # another batch's object
           "batch_deep": "[" * 100000 + "]" * 100000, "batch_binary": "\udcff"}
    for name, text in bad.items():
        (root / f"{name}.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    (root / "batch_list.json.corrupt").write_text("an older quarantined file")

    with caplog.at_level(logging.WARNING, logger="batchrun.server.stored"):
        manager = BatchManager(None, root)
    batches, more = manager.list()
    assert [b["id"] for b in batches] == ["batch_good"] and not more
    for name in bad:
        assert not (root / f"{name}.json").exists(), name
        assert any(f"{name}.json" in r.getMessage() for r in caplog.records), name
    assert (root / "batch_truncated.json.corrupt").read_text() == bad["batch_truncated"]
    assert (root / "batch_list.json.corrupt").read_text() == "an older quarantined file"
    assert (root / "batch_list.json.corrupt.1").read_text() == "[1, 2]"
    assert len(caplog.records) == len(bad)


def test_corrupt_file_objects_are_quarantined_and_the_rest_load(tmp_path, caplog):
    root = tmp_path / "files"
    root.mkdir()
    for file_id in ("file-good", "file-truncated", "file-bytes"):
        (root / file_id).write_text("{}\n")
    (root / "file-good.json").write_text(json.dumps(file_object("file-good")))
    (root / "file-truncated.json").write_text(json.dumps(file_object("file-truncated"))[:20])
    (root / "file-bytes.json").write_text(json.dumps({**file_object("file-bytes"), "bytes": "3"}))

    with caplog.at_level(logging.WARNING, logger="batchrun.server.stored"):
        store = FileStore(root)
    assert [f["id"] for f in store.list()[0]] == ["file-good"]
    assert store.path("file-good").read_text() == "{}\n"
    with pytest.raises(APIError):
        store.get("file-truncated")
    assert sorted(p.name for p in root.glob("*.corrupt")) == ["file-bytes.json.corrupt",
                                                              "file-truncated.json.corrupt"]
    assert len(caplog.records) == 2 and "file-truncated.json" in caplog.text


def test_a_failed_upload_or_state_write_leaves_no_temp_file_and_the_old_state(tmp_path):
    from batchrun.server.stored import write_json_atomic

    class Broken:
        def __init__(self):
            self.reads = 0

        def read(self, n=-1):
            self.reads += 1
            if self.reads > 1:
                raise ConnectionResetError("the client went away")
            return b'{"custom_id": "a"}\n'

    store = FileStore(tmp_path / "files")
    with pytest.raises(ConnectionResetError):
        store.upload(Broken(), "in.jsonl", "batch")
    assert list((tmp_path / "files").iterdir()) == [] and store.list()[0] == []

    state = tmp_path / "batch_x.json"
    write_json_atomic(state, {"id": "batch_x", "status": "in_progress"})
    with pytest.raises(TypeError):
        write_json_atomic(state, {"id": "batch_x", "status": object()})
    assert json.loads(state.read_text())["status"] == "in_progress"
    assert sorted(tmp_path.iterdir()) == [state, tmp_path / "files"]
