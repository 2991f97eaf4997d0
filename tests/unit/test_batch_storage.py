"""Storage pieces of the batch runner: formats, readers, the id set, staging and merge, sinks."""

import gzip
import json
import os
from io import BytesIO

import pytest

from batchrun.batch.storage import io

from batchrun.batch.job import staging as staging_mod
from batchrun.batch.storage.formats import (Format, compress, decompress, detect, parse_format,
                                    stream_errors)
from batchrun.batch.job.idset import IdSet
from batchrun.batch.storage.lines import position, split_position
from batchrun.batch.storage.readers import open_sources, read_all
from batchrun.batch.storage.sinks import RecordSink
from batchrun.batch.job.staging import (EXPIRED, FAILED, OK, RETRYABLE, Record, Staging,
                                        StagingError)
from batchrun.batch.storage.store import Storage


@pytest.mark.parametrize("path,fmt", [
    ("a.jsonl", Format("jsonl")), ("s3://b/a.JSONL.GZ", Format("jsonl", "gzip")),
    ("a.jsonl.zst", Format("jsonl", "zstd")), ("x/a.parquet", Format("parquet")),
    ("-", Format("jsonl")), ("noext", Format("jsonl")), ("a.ndjson", Format("jsonl")),
])
def test_format_follows_the_extension(path, fmt):
    assert detect(path) == fmt


def test_format_override_and_errors():
    assert detect("data.bin", "parquet") == Format("parquet")
    assert str(parse_format("jsonl.gz")) == "jsonl.gz"
    with pytest.raises(ValueError, match="unknown format"):
        parse_format("csv")
    with pytest.raises(ValueError, match="Parquet compresses"):
        detect("a.parquet.gz")


def test_sibling_paths():
    assert io.sibling_path("out.jsonl", ".errors.jsonl") == "out.errors.jsonl"
    assert io.sibling_path("s3://b/o/out.jsonl.gz", ".metrics.json") == "s3://b/o/out.metrics.json"
    assert io.sibling_path("out.parquet", ".errors.parquet") == "out.errors.parquet"


def test_storage_options_flat_or_by_protocol():
    flat = {"endpoint_url": "http://127.0.0.1:1"}
    assert io.options_for("s3://b/k", flat) == flat
    assert io.options_for("https://h/x.jsonl", flat) == {}
    assert io.options_for("/local/x", flat) == {}
    keyed = {"s3": flat, "https": {"headers": {"a": "b"}}}
    assert io.options_for("s3://b/k", keyed) == flat
    assert io.options_for("https://h/x", keyed) == {"headers": {"a": "b"}}


def test_several_inputs_folders_and_globs_keep_a_stable_order(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "c.parquet", "notes.txt", ".hidden.jsonl"):
        (tmp_path / name).write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.jsonl.gz").write_bytes(gzip.compress(b""))
    (tmp_path / "out.jsonl.batchrun-staging").mkdir()
    (tmp_path / "out.jsonl.batchrun-staging" / "part-00001-000001.jsonl").write_text("")
    found = io.expand_inputs([str(tmp_path)])
    assert [p.rsplit("/", 1)[-1] for p in found] == ["a.jsonl", "b.jsonl", "c.parquet",
                                                      "d.jsonl.gz"]
    assert io.expand_inputs([str(tmp_path / "*.jsonl")]) == [
        str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    assert io.expand_inputs([str(tmp_path / "b.jsonl"), "-"]) == [str(tmp_path / "b.jsonl"), "-"]
    with pytest.raises(FileNotFoundError):
        io.expand_inputs([str(tmp_path / "missing.jsonl")])
    with pytest.raises(FileNotFoundError, match="matches no input"):
        io.expand_inputs([str(tmp_path / "*.csv")])


def test_jsonl_reader_streams_lines_and_flags_bad_bytes(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"a": 1}\n\n   \n{"b": "\xff\xfe"}\n{"c": 3}')
    items = list(read_all(open_sources([str(src)])))
    assert [(i.line, i.text) for i in items if i.problem is None] == [(1, '{"a": 1}\n'),
                                                                    (5, '{"c": 3}')]
    bad = [i for i in items if i.problem is not None]
    assert len(bad) == 1 and bad[0].line == 4 and bad[0].problem.code == "invalid_encoding"


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst", ".jsonl.bz2", ".jsonl.xz"])
def test_compressed_inputs(tmp_path, suffix):
    src = tmp_path / ("in" + suffix)
    sink = RecordSink(str(src), detect(str(src)))
    for i in range(3):
        sink.write(json.dumps({"i": i}))
    sink.commit()
    assert [json.loads(i.text)["i"] for i in read_all(open_sources([str(src)]))] == [0, 1, 2]


@pytest.mark.parametrize("codec", ["gzip", "bz2", "xz", "zstd"])
def test_codecs_leave_the_stream_open_and_raise_on_truncated_data(codec):
    data = b"".join(b'{"custom_id": "r%d"}\n' % i for i in range(3000))
    raw = BytesIO()
    writer = compress(raw, codec)
    writer.write(data)
    writer.close()
    assert not raw.closed  # the local sink fsyncs it after the codec is done
    blob = raw.getvalue()
    assert decompress(BytesIO(blob), codec).read() == data
    if codec != "zstd":  # zstandard's reader ends quietly at a cut (see formats.py)
        with pytest.raises(stream_errors(codec)):
            decompress(BytesIO(blob[: len(blob) // 2]), codec).read()


def test_zstd_reads_every_frame():
    import zstandard

    frames = [b'{"a": %d}\n' % i * 1000 for i in range(3)]
    blob = b"".join(zstandard.ZstdCompressor().compress(f) for f in frames)
    assert decompress(BytesIO(blob), "zstd").read() == b"".join(frames)


def test_positions_order_files_then_lines():
    assert position(0, 5) < position(0, 6) < position(1, 1)
    assert split_position(position(3, 12345)) == (3, 12345)


def test_id_set_finds_duplicates_across_merges():
    ids = IdSet()
    n = 40_000  # past the first merges of the recent buffer into the sorted buckets
    assert all(ids.add(f"id-{i}") for i in range(n))
    assert len(ids) == n
    assert not ids.add("id-0") and not ids.add(f"id-{n - 1}") and "id-123" in ids
    assert ids.add("new") and "never" not in ids


def test_id_set_handles_digests_ending_in_nul_bytes():
    keys = [f"k{i}" for i in range(5000)]
    short = [k for k in keys if len(IdSet._digest(k)) < 16]
    assert short, "some digests end in a NUL byte"
    ids = IdSet()
    for k in keys:
        ids.add(k)
    ids._merge()
    assert all(k in ids and not ids.add(k) for k in short)
    assert "other" not in ids


def _records(*specs):
    return [Record(pos, state, json.dumps({"pos": pos, "state": state})) for pos, state in specs]


def test_staging_commits_scans_and_merges_in_input_order(tmp_path):
    st = Staging(str(tmp_path / "stage"))
    st.create({"inputs": [["in.jsonl", 10]]})
    st.commit(_records((5, OK), (1, FAILED)))
    st.commit(_records((3, RETRYABLE), (2, OK)))
    committed = Staging(str(tmp_path / "stage")).scan()
    assert [committed.get(0, i) for i in range(7)] == [0, FAILED, OK, RETRYABLE, 0, OK, 0]
    assert committed.count == 4
    # A later attempt (a retried error) supersedes the earlier record for the same line.
    again = Staging(str(tmp_path / "stage"))
    again.scan()
    assert again.attempt == 2
    again.commit(_records((3, OK)))
    ok, err = [], []
    counts = again.merge(ok.append, err.append)
    assert [json.loads(t)["pos"] for t in ok] == [2, 3, 5]
    assert [json.loads(t)["pos"] for t in err] == [1]
    assert counts == {OK: 3, FAILED: 1, RETRYABLE: 0, EXPIRED: 0}


def test_merge_with_more_parts_than_the_fan_in(tmp_path, monkeypatch):
    monkeypatch.setattr(staging_mod, "FAN_IN", 3)
    st = Staging(str(tmp_path / "stage"))
    st.create({"inputs": []})
    positions = list(range(1, 41))
    import random

    random.Random(0).shuffle(positions)
    for i in range(0, 40, 4):
        st.commit(_records(*[(p, OK) for p in positions[i:i + 4]]))
    st.commit(_records((7, FAILED)))  # a later record for line 7 wins
    ok, err = [], []
    st.merge(ok.append, err.append)
    assert [json.loads(t)["pos"] for t in ok] == [p for p in range(1, 41) if p != 7]
    assert [json.loads(t)["pos"] for t in err] == [7]
    assert not [n for n in st._names() if n.startswith("merge-")]


def test_scratch_from_a_crash_is_ignored_and_cleaned(tmp_path):
    st = Staging(str(tmp_path / "stage"))
    st.create({"inputs": []})
    st.commit(_records((1, OK)))
    (tmp_path / "stage" / ".part-00001-000002.jsonl.123.tmp").write_text("half a part")
    (tmp_path / "stage" / "merge-01-00000.jsonl").write_text("1 1 {}\n")
    again = Staging(str(tmp_path / "stage"))
    assert again.scan().count == 1
    again.clean_scratch()
    assert sorted(p.name for p in (tmp_path / "stage").iterdir()) == [
        "manifest.json", "part-00001-000001.jsonl"]


def test_staging_refuses_other_inputs(tmp_path):
    st = Staging(str(tmp_path / "stage"))
    st.create({"inputs": [["a.jsonl", 10]]})
    st.check_inputs([["a.jsonl", 10]])
    st.check_inputs([["a.jsonl", None]])  # size unknown (stdin, some http servers)
    # Another size is the same file changed: its lines are checked one by one by their digests.
    st.check_inputs([["a.jsonl", 11]])
    with pytest.raises(StagingError, match="other inputs"):
        st.check_inputs([["b.jsonl", 10]])
    with pytest.raises(StagingError):
        st.check_inputs([["a.jsonl", 10], ["b.jsonl", 1]])


def test_sink_publishes_whole_files_only(tmp_path):
    target = tmp_path / "out.jsonl"
    target.write_text("previous\n")
    sink = RecordSink(str(target), Format("jsonl"))
    sink.write('{"a": 1}')
    assert target.read_text() == "previous\n"  # nothing visible before commit
    sink.abort()
    assert target.read_text() == "previous\n" and list(tmp_path.iterdir()) == [target]
    sink = RecordSink(str(target), Format("jsonl"))
    sink.write('{"a": 2}')
    sink.commit()
    assert target.read_text() == '{"a": 2}\n' and list(tmp_path.iterdir()) == [target]


def test_part_order_survives_wider_sequence_numbers(tmp_path):
    st = Staging(str(tmp_path / "stage"))
    st.create({"inputs": []})
    st._seq = 999_998
    st.commit(_records((1, FAILED)))  # part-00001-999999
    st.commit(_records((1, OK)))  # part-00001-1000000: later, so it wins
    ok, err = [], []
    st.merge(ok.append, err.append)
    assert len(ok) == 1 and err == []
    assert Staging(str(tmp_path / "stage")).scan().get(0, 1) == OK


class Midway(Exception):
    pass


def test_atomic_local_file_keeps_the_old_content_and_no_temp_when_a_write_fails(tmp_path):
    target = tmp_path / "out.json"
    target.write_bytes(b"old")
    with pytest.raises(Midway):
        with io.atomic_local_file(target) as f:
            f.write(b"half of the new")
            raise Midway()
    assert target.read_bytes() == b"old" and list(tmp_path.iterdir()) == [target]
    with io.atomic_local_file(tmp_path / "new" / "folder" / "x.bin") as f:  # folders made
        f.write(b"new")
    assert (tmp_path / "new" / "folder" / "x.bin").read_bytes() == b"new"
    assert os.listdir(tmp_path / "new" / "folder") == ["x.bin"]


def test_write_bytes_atomic_keeps_the_old_content_when_the_rename_fails(tmp_path, monkeypatch):
    target = tmp_path / "m.json"
    target.write_bytes(b"old")

    def refuse(src, dst):
        raise PermissionError(dst)
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError):
        io.write_bytes_atomic(str(target), b"new")
    assert target.read_bytes() == b"old" and list(tmp_path.iterdir()) == [target]


def test_sink_takes_a_storage_or_plain_options(tmp_path):
    for i, storage in enumerate((Storage(), Storage({"s3": {"anon": True}}), None, {})):
        target = tmp_path / f"out{i}.jsonl"
        sink = RecordSink(str(target), Format("jsonl"), storage)
        sink.write('{"a": 1}')
        sink.commit()
        assert target.read_text() == '{"a": 1}\n'
    sink = RecordSink("memory://sink/out.jsonl", Format("jsonl"), Storage())
    sink.write('{"a": 2}')
    sink.commit()
    assert Storage().open_read("memory://sink/out.jsonl").read() == b'{"a": 2}\n'
