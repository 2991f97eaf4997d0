"""Hostile lines and operator mistakes, in-process: each is refused for that line (or before
anything runs) with a message naming the line, field or path; nothing else is affected."""

import errno
import gzip
import json
import os

import pytest

from batchrun.batch.storage import io
from batchrun.batch.storage.lines import InputReadError
from batchrun.batch.job.runner import BatchConfigError, run_batch
from batchrun.batch.storage.sinks import RecordSink
from batchrun.batch.storage.formats import Format
from batchrun.openai.wire import LineError, RequestError, parse_batch_line, parse_body
from tests.helpers import job_plan
from tests.fake_engine import FakeEngine, fake_model
from tests.openai_batch_shape import error_of

CHAT = "/v1/chat/completions"


def body(**fields):
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def line(custom_id, **fields):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT,
                       "body": body(**fields)})


def refused(fields, param):
    with pytest.raises(RequestError) as info:
        parse_body(CHAT, body(**fields))
    assert info.value.param == param, info.value.message
    assert info.value.status_code == 400
    return info.value


@pytest.mark.parametrize("seed", [2 ** 63, -(2 ** 63) - 1, 1208925819614629174706176])
def test_a_seed_past_64_bits_is_refused(seed):
    refused({"seed": seed}, "seed")


def test_a_seed_at_the_64_bit_limits_is_taken():
    for seed in (2 ** 63 - 1, -(2 ** 63)):
        assert parse_body(CHAT, body(seed=seed)).seed == seed


@pytest.mark.parametrize("key", ["²", "١٢", "-1", " 1", "1" * 11, ""])
def test_logit_bias_keys_must_be_ascii_token_ids(key):
    error = refused({"logit_bias": {key: 1.0}}, "logit_bias")
    assert "token ids" in error.message


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 2 ** 31}, "max_tokens"),
    ({"max_completion_tokens": 2 ** 40}, "max_completion_tokens"),
    ({"top_k": 2 ** 31}, "top_k"),
    ({"min_tokens": 2 ** 31}, "min_tokens"),
    ({"stop_token_ids": [2 ** 31]}, "stop_token_ids.0"),
    ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1.0 for i in range(1025)}}, "logit_bias"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata.kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk.[key]"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "tools"),
])
def test_every_field_is_bounded_to_what_the_engine_takes(fields, param):
    refused(fields, param)


def test_deep_nesting_is_an_error_for_that_line_not_a_crash():
    deep = '{"custom_id": "d", "method": "POST", "url": "/v1/chat/completions", "body": ' + \
        "[" * 10000 + "]" * 10000 + "}"
    with pytest.raises(LineError) as info:
        parse_batch_line(deep, 7)
    assert info.value.code == "invalid_json" and "depth" in info.value.message
    within_json = {"messages": [{"role": "user", "content": "x"}],
                   "chat_template_kwargs": {"a": json.loads("[" * 200 + "]" * 200)}}
    with pytest.raises(RequestError, match="nested more than 64 levels"):
        parse_body(CHAT, within_json)


def test_json_errors_name_the_real_column():
    with pytest.raises(LineError) as info:
        parse_batch_line('{"custom_id": "a", "body": {"messages": "unterminated\n', 3)
    message = str(info.value)
    # The text ends at column 53: the error is just past it, not "at column 1".
    assert message.startswith("line 3: invalid JSON: ") and message.endswith(" at column 54")
    assert "at at" not in message


def config(tmp_path, src, **options):
    options.setdefault("progress", "none")
    return job_plan(input=str(src), output=str(tmp_path / "out.jsonl"), **options)


HOSTILE = [
    line("seed", seed=1208925819614629174706176),
    line("bias", logit_bias={"²": 5}),
    '{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": '
    + "[" * 10000 + "]" * 10000 + "}",
    line("ok1"),
    line("schema", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nonsense"}}}]),
    line("ok2"),
]


def test_a_file_of_hostile_lines_completes_with_an_error_record_each(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(HOSTILE) + "\n")
    result = run_batch(fake_model(), config(tmp_path, src))
    assert result.status == "completed"
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["ok1", "ok2"]
    by_id = {e["custom_id"] or "deep": error_of(e) for e in errors}  # not JSON: no custom_id
    assert set(by_id) == {"seed", "bias", "deep", "schema"}
    assert by_id["seed"]["param"] == "seed" and by_id["bias"]["param"] == "logit_bias"
    assert by_id["schema"]["param"] == "tools.0.function.parameters"
    assert by_id["deep"]["code"] == "invalid_json" and by_id["deep"]["line"] == 3


def test_a_non_utf8_line_keeps_its_readable_custom_id(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(line("ascii-id").encode().replace(b'"hi"', b'"h\xff\xfei"') + b"\n")
    run_batch(fake_model(), config(tmp_path, src))
    (error,) = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert error["custom_id"] == "ascii-id" and error_of(error)["code"] == "invalid_encoding"


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=3).compress(data)


@pytest.mark.parametrize("ext,pack", [("gz", gzip.compress), ("zst", _zstd)])
def test_a_truncated_compressed_input_commits_its_complete_lines_then_names_the_offset(
        tmp_path, ext, pack):
    # 3,000 lines: several zstd blocks (up to 128 KiB each; a block cut short decodes nothing).
    N = 3000
    data = "".join(line(f"r{i}") + "\n" for i in range(N)).encode()
    packed = pack(data)
    src = tmp_path / f"in.jsonl.{ext}"
    src.write_bytes(packed[: len(packed) // 2])
    engine = FakeEngine()
    with pytest.raises(InputReadError, match=rf"in\.jsonl\.{ext}: the input breaks off after "
                                             r"byte [\d,]+ of its decompressed content") as info:
        run_batch(fake_model(engine), config(tmp_path, src))
    complete = int(str(info.value).split("The ")[1].split(" lines")[0].replace(",", ""))
    assert 0 < complete < N and len(engine.added) == complete
    # Every complete line is committed: the whole file, once replaced, resumes from there.
    src.write_bytes(packed)
    again = FakeEngine()
    result = run_batch(fake_model(again), config(tmp_path, src, resume=True))
    assert result.status == "completed" and len(again.added) == N - complete
    out = [json.loads(x)["custom_id"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert out == [f"r{i}" for i in range(N)]


def test_output_equal_to_the_input_is_refused_before_anything_runs(tmp_path):
    src = tmp_path / "same.jsonl"
    src.write_text(line("a") + "\n")
    before = src.read_bytes()
    for output in (str(src), f"{tmp_path}/./same.jsonl", f"file://{src}"):
        with pytest.raises(BatchConfigError, match="is also an input"):
            (job_plan(input=str(src), output=output, progress="none"))
    with pytest.raises(BatchConfigError, match="error file .* is also an input"):
        (job_plan(input=str(src), output=str(tmp_path / "o.jsonl"),
                               errors=str(src), progress="none"))
    assert src.read_bytes() == before


def test_an_unwritable_output_location_is_refused_naming_the_path(tmp_path, monkeypatch):
    src = tmp_path / "in.jsonl"
    src.write_text(line("a") + "\n")
    (tmp_path / "afile").write_text("")
    with pytest.raises(BatchConfigError, match="afile is not a folder"):
        (config(tmp_path, src, metrics=str(tmp_path / "afile" / "m.json")))
    ro = tmp_path / "ro"
    ro.mkdir()
    real_open = os.open

    def read_only_mount(path, flags, *args):
        if str(path).startswith(str(ro)) and flags & (os.O_WRONLY | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, *args)
    monkeypatch.setattr(os, "open", read_only_mount)
    with pytest.raises(BatchConfigError, match=f"cannot write the output {ro}/out.jsonl .*"
                                               "Read-only file system"):
        (job_plan(input=str(src), output=str(ro / "out.jsonl"), progress="none"))


def test_an_existing_output_of_another_input_is_not_overwritten(tmp_path):
    first, other = tmp_path / "first.jsonl", tmp_path / "other.jsonl"
    first.write_text(line("a") + "\n")
    other.write_text(line("b") + "\n")
    run_batch(fake_model(), config(tmp_path, first))
    before = (tmp_path / "out.jsonl").read_bytes()
    with pytest.raises(BatchConfigError, match=r"out\.jsonl already exists and is not this "
                                               r"job's result.*--overwrite"):
        (config(tmp_path, other))
    with pytest.raises(BatchConfigError, match="--overwrite"):
        run_batch(fake_model(), config(tmp_path, other))
    assert (tmp_path / "out.jsonl").read_bytes() == before
    # This job's own completed result may be replaced by running it again...
    run_batch(fake_model(), config(tmp_path, first))
    # ... and the other input's only when asked.
    run_batch(fake_model(), config(tmp_path, other, overwrite=True))
    assert json.loads((tmp_path / "out.jsonl").read_text())["custom_id"] == "b"
    (tmp_path / "out.metrics.json").unlink()  # a file nothing says batchrun made
    with pytest.raises(BatchConfigError, match="not this job's result"):
        (config(tmp_path, other))


def test_a_full_disk_leaves_no_scratch_file(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", full)
    sink = RecordSink(str(tmp_path / "out.jsonl"), Format("jsonl"))
    sink.write("{}")
    with pytest.raises(OSError):
        try:
            sink.commit()
        except OSError:
            sink.abort()
            raise
    with pytest.raises(OSError):
        io.write_bytes_atomic(str(tmp_path / "m.json"), b"{}")
    assert os.listdir(tmp_path) == []


def test_an_unknown_field_named_like_another_endpoints_field_is_only_ignored(smol_tokenizer):
    from batchrun.openai.serving import OpenAIServing
    from batchrun.served_model import TokenizerModel

    model = TokenizerModel(smol_tokenizer, "m", max_model_len=64)
    # max_completion_tokens and metadata are chat fields: on /v1/completions they are unknown.
    prepared = OpenAIServing(model).prepare("/v1/completions", {
        "prompt": "hi", "max_completion_tokens": {"a": 1}, "metadata": [1, 2]})
    from batchrun.openai.params import declared

    assert prepared.params.max_tokens == 16 and declared(prepared.request, "metadata") is None


def test_a_line_that_crashes_the_engine_on_admission_fails_alone(tmp_path):
    class Refusing(FakeEngine):
        def add_request(self, request_id, prompt_token_ids, params, arrival_time=None):
            if b"boom" in bytes(prompt_token_ids):
                raise KeyError("injected")
            super().add_request(request_id, prompt_token_ids, params, arrival_time)

    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([line("a"), json.dumps({
        "custom_id": "b", "method": "POST", "url": CHAT,
        "body": {"messages": [{"role": "user", "content": "boom"}]}}), line("c")]) + "\n")
    result = run_batch(fake_model(Refusing()), config(tmp_path, src))
    assert result.status == "completed"
    out = [json.loads(x)["custom_id"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    (error,) = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert out == ["a", "c"] and error["custom_id"] == "b"
    assert error_of(error)["code"] == "internal_error" and error["response"]["status_code"] == 500
