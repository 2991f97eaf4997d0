"""Batch lines with images on a tiny random-weight VLM: images from data: URLs, a loopback HTTP
server, a moto S3 bucket and an allowed local directory run to transformers' tokens; each image
of the hostile corpus is one error record naming the line and the content part."""

import base64
import io
import json

import pytest
import torch

from batchrun.batch.job.runner import run_batch
from batchrun.llm import load_from_path
from batchrun.options.engine import EngineConfig
from tests.helpers import job_plan
from tests.image_server import HOST, ImageServer
from tests.openai_batch_shape import error_of
from tests.tiny_vlms import image, make_tiny_vlm

MAX_TOKENS = 5


def png(img, fmt="PNG") -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt)
    return out.getvalue()


RED, BLUE, GREEN = image(40, 30, 11), image(32, 48, 12), image(50, 50, 13)
ROUTES = {
    "/red.png": png(RED),
    "/blue.png": png(BLUE),
    "/text.png": b"this is not an image at all",
    "/truncated.png": png(image(64, 64, 14))[:300],
    "/bomb.png": png(image(1, 1, 0).resize((3000, 3000))),
    "/image.ppm": png(image(20, 20, 15), "PPM"),
}


@pytest.fixture(scope="module")
def images_http():
    with ImageServer(ROUTES, slow={"/slow.png": 5.0}) as server:
        yield server


@pytest.fixture(scope="module")
def http_base(images_http):
    return images_http.base


@pytest.fixture(scope="module")
def s3_bucket():
    pytest.importorskip("moto.server")
    from tests.moto_s3 import moto_s3

    with moto_s3("imgs") as (fs, options):
        fs.pipe("imgs/green.png", png(GREEN))
        yield options


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, smol_tokenizer):
    path = tmp_path_factory.mktemp("llava")
    hf, processor = make_tiny_vlm("llava", path, smol_tokenizer)
    threads = torch.get_num_threads()
    loaded = load_from_path(path, EngineConfig.default(block_size=4, num_blocks=512, threads=1))
    torch.set_num_threads(1)
    yield hf, processor, loaded
    torch.set_num_threads(threads)


def line(custom_id, *urls, text="What is in the picture?"):
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": u, "detail": "auto"}} for u in urls]
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "max_tokens": MAX_TOKENS, "temperature": 0,
                                "messages": [{"role": "user", "content": parts}]}})


def responses_line(custom_id, url, text="What is in the picture?"):
    parts = [{"type": "input_text", "text": text}, {"type": "input_image", "image_url": url}]
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/responses",
                       "body": {"model": "m", "max_output_tokens": MAX_TOKENS, "temperature": 0,
                                "input": [{"role": "user", "content": parts}]}})


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png(img)).decode()


def expected(hf, processor, images, text="What is in the picture?"):
    """(completion text, prompt tokens) from transformers' generate on the processor's output."""
    parts = [{"type": "text", "text": text}] + [{"type": "image"} for _ in images]
    prompt = processor.apply_chat_template([{"role": "user", "content": parts}],
                                           add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[prompt], images=images, return_tensors="pt")
    out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    return processor.tokenizer.decode(new, skip_special_tokens=True), inputs["input_ids"].shape[1]


def test_images_from_everywhere_and_hostile_images_fail_alone(vlm, http_base, images_http,
                                                                s3_bucket, tmp_path):
    hf, processor, loaded = vlm
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "blue.png").write_bytes(png(BLUE))
    (tmp_path / "secret.png").write_bytes(png(BLUE))
    good = {
        "data": ([data_url(RED)], [RED]),
        "http": ([f"{http_base}/red.png"], [RED]),
        "http-again": ([f"{http_base}/red.png"], [RED]),
        "s3": (["s3://imgs/green.png"], [GREEN]),
        "local": ([str(allowed / "blue.png")], [BLUE]),
        "two": ([f"{http_base}/blue.png", f"{http_base}/red.png"], [BLUE, RED]),
    }
    bad = {  # custom_id: (urls, error code, index of the failing image part)
        "404": ([f"{http_base}/missing.png"], "image_fetch_failed", 1),
        "unreachable": (["http://127.0.0.1:9/x.png"], "image_fetch_failed", 1),
        "timeout": ([f"{http_base}/slow.png"], "image_fetch_failed", 1),
        "not-image": ([f"{http_base}/text.png"], "invalid_image", 1),
        "truncated": ([f"{http_base}/truncated.png"], "invalid_image", 1),
        "bomb": ([f"{http_base}/bomb.png"], "image_too_large", 1),
        "format": ([f"{http_base}/image.ppm"], "unsupported_image_format", 1),
        "too-many": ([data_url(RED)] * 3, "too_many_images", 3),
        "outside": ([str(tmp_path / "secret.png")], "media_path_not_allowed", 1),
        "bad-base64": (["data:image/png;base64,@@@"], "invalid_value", 1),
        "s3-missing": (["s3://imgs/none.png"], "image_fetch_failed", 1),
    }
    lines = [line(cid, *urls) for cid, (urls, _) in good.items()]
    lines += [line(cid, *urls) for cid, (urls, _, _) in bad.items()]
    lines += [responses_line("responses", f"{http_base}/blue.png"),
              responses_line("responses-404", f"{http_base}/gone.png")]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    plan = job_plan(input=str(src), output=str(tmp_path / "out.jsonl"), progress="none",
                    ignore_model_field=True, storage_options=s3_bucket,
                    allowed_media_path=str(allowed), limit_images_per_prompt=2,
                    media_max_pixels=1_000_000, media_fetch_timeout=1.5, media_fetch_retries=1,
                    allow_media_host=[HOST])
    summary = run_batch(loaded, plan)
    out = {r["custom_id"]: r for r in map(json.loads, open(tmp_path / "out.jsonl"))}
    errors = {r["custom_id"]: r for r in map(json.loads, open(tmp_path / "out.errors.jsonl"))}
    assert set(out) == set(good) | {"responses"}, (summary, errors)
    assert set(errors) == set(bad) | {"responses-404"}, (summary, errors)
    response = out["responses"]["response"]["body"]
    text, prompt_tokens = expected(hf, processor, [BLUE])
    assert response["output"][0]["content"][0]["text"] == text
    assert response["usage"]["input_tokens"] == prompt_tokens
    assert error_of(errors["responses-404"])["param"] == "input.0.content.1.image_url"
    assert error_of(errors["responses-404"])["code"] == "image_fetch_failed"
    for cid, (_, images) in good.items():
        body = out[cid]["response"]["body"]
        text, prompt_tokens = expected(hf, processor, images)
        assert body["choices"][0]["message"]["content"] == text, cid
        assert body["usage"]["prompt_tokens"] == prompt_tokens, cid
    for number, (cid, (_, code, part)) in enumerate(bad.items(), start=len(good) + 1):
        err = error_of(errors[cid])
        assert err["code"] == code, (cid, err)
        where = f"messages.0.content.{part}.image_url" + ("" if code == "too_many_images" else ".url")
        assert err["param"] == where, (cid, err)
        assert f"line {number}" in err["message"] and where in err["message"], (cid, err)
    assert images_http.hits["/red.png"] == 1  # three lines, one fetch
    assert images_http.hits["/slow.png"] == 2  # a timeout is retried
    assert images_http.hits["/missing.png"] == 1  # a 404 is not
    # the repeated image's placeholder blocks came from the prefix cache
    assert out["http-again"]["response"]["body"]["usage"]["prompt_tokens_details"][
        "cached_tokens"] > 0


def test_a_slow_image_holds_back_only_its_own_line_until_the_deadline(vlm, http_base,
                                                                      images_http, tmp_path):
    """The first line's image host answers in 5 s (x3 attempts); the lines after it run at
    once, and at the --deadline only the slow line gets its batch_expired line."""
    import time

    _, _, loaded = vlm
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([line("slow", f"{http_base}/slow.png"),
                              line("red", f"{http_base}/red.png"),
                              line("blue", f"{http_base}/blue.png"),
                              line("data", data_url(GREEN))]) + "\n")
    plan = job_plan(input=str(src), output=str(tmp_path / "out.jsonl"), progress="none",
                    ignore_model_field=True, allow_media_host=[HOST], deadline="4s")
    started = time.monotonic()
    result = run_batch(loaded, plan)
    assert time.monotonic() - started < 8
    assert result.status == "expired"
    out = {r["custom_id"] for r in map(json.loads, open(tmp_path / "out.jsonl"))}
    errors = {r["custom_id"]: error_of(r) for r in map(json.loads,
                                                       open(tmp_path / "out.errors.jsonl"))}
    assert out == {"red", "blue", "data"}
    assert list(errors) == ["slow"] and errors["slow"]["code"] == "batch_expired"


def test_a_text_only_model_refuses_image_parts_naming_them():
    from batchrun.openai.wire import RequestError
    from batchrun.openai.serving import OpenAIServing
    from tests.fake_engine import fake_model

    model = fake_model()
    serving = OpenAIServing(model)
    assert serving.media is None
    chat = dict(json.loads(line("c", data_url(RED)))["body"], model=model.name)
    with pytest.raises(RequestError) as e:
        serving.prepare("/v1/chat/completions", chat)
    assert (e.value.code, e.value.param) == ("unsupported_content", "messages.0.content.1")
    responses = dict(json.loads(responses_line("r", data_url(RED)))["body"], model=model.name)
    with pytest.raises(RequestError) as e:
        serving.prepare("/v1/responses", responses)
    assert (e.value.code, e.value.param) == ("unsupported_content", "input.0.content.1.type")


def test_validate_checks_image_parts_and_fetches_them_only_when_asked(http_base, images_http,
                                                                     tmp_path):
    from click.testing import CliRunner

    from batchrun.batch.shell.commands import validate

    allowed = tmp_path / "media"
    allowed.mkdir()
    lines = [line("ok", data_url(RED)), line("b64", "data:image/png;base64,@@@"),
             line("many", *[data_url(RED)] * 3), line("outside", str(tmp_path / "x.png")),
             line("gone", f"{http_base}/nothing-here.png"),
             responses_line("r-outside", "/etc/passwd")]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    args = [str(src), "--json", "--ignore-model-field", "--limit-images-per-prompt", "2",
            "--allowed-media-path", str(allowed), "--allow-media-host", HOST]
    hits = images_http.hits.get("/nothing-here.png", 0)
    plain = CliRunner().invoke(validate, args)
    problems = {r["custom_id"]: error_of(r) for r in map(json.loads, plain.stdout.splitlines())}
    assert {k: (e["code"], e["param"]) for k, e in problems.items()} == {
        "b64": ("invalid_value", "messages.0.content.1.image_url.url"),
        "many": ("too_many_images", "messages.0.content.3.image_url"),
        "outside": ("media_path_not_allowed", "messages.0.content.1.image_url.url"),
        "r-outside": ("media_path_not_allowed", "input.0.content.1.image_url"),
    }, plain.output
    assert images_http.hits.get("/nothing-here.png", 0) == hits  # nothing fetched
    fetched = CliRunner().invoke(validate, args + ["--fetch-media"])
    problems = {r["custom_id"]: error_of(r) for r in map(json.loads, fetched.stdout.splitlines())}
    assert set(problems) == {"b64", "many", "outside", "r-outside", "gone"}, fetched.output
    assert problems["gone"]["code"] == "image_fetch_failed"
    assert fetched.exit_code == plain.exit_code == 3


def test_serve_answers_the_openai_clients_image_messages(vlm, http_base, tmp_path):
    """Chat and Responses through `serve` with the official client: the same tokens as
    transformers; a bad image is a 400 naming the part; the Batches API runs image lines."""
    import openai

    from tests.server.conftest import serve

    hf, processor, loaded = vlm
    with serve(loaded, tmp_path / "server", allow_media_host=[HOST]) as running:
        client = running.client()
        reply = client.chat.completions.create(
            model=loaded.name, max_tokens=MAX_TOKENS, temperature=0, messages=[{
                "role": "user", "content": [
                    {"type": "text", "text": "What is in the picture?"},
                    {"type": "image_url", "image_url": {"url": data_url(GREEN)}}]}])
        text, prompt_tokens = expected(hf, processor, [GREEN])
        assert reply.choices[0].message.content == text
        assert reply.usage.prompt_tokens == prompt_tokens
        response = client.responses.create(
            model=loaded.name, max_output_tokens=MAX_TOKENS, temperature=0, input=[{
                "role": "user", "content": [
                    {"type": "input_text", "text": "What is in the picture?"},
                    {"type": "input_image", "image_url": f"{http_base}/red.png"}]}])
        assert response.output_text == expected(hf, processor, [RED])[0]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=loaded.name, max_tokens=2, messages=[{
                "role": "user", "content": [
                    {"type": "text", "text": "Hi"},
                    {"type": "image_url", "image_url": {"url": f"{http_base}/absent.png"}}]}])
        assert e.value.body["param"] == "messages.0.content.1.image_url.url"
        # the Batches API: one good image line, one whose image is missing
        from tests.helpers import poll_batch

        lines = [json.loads(line("ok", f"{http_base}/blue.png")),
                 json.loads(line("bad", f"{http_base}/also-absent.png"))]
        for x in lines:
            x["body"]["model"] = loaded.name
        f = client.files.create(file=("in.jsonl", io.BytesIO(
            "".join(json.dumps(x) + "\n" for x in lines).encode())), purpose="batch")
        batch = poll_batch(client, client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)
        assert batch.status == "completed", batch
        (ok,) = map(json.loads, client.files.content(batch.output_file_id).text.splitlines())
        assert ok["response"]["body"]["choices"][0]["message"]["content"] == \
            expected(hf, processor, [BLUE])[0]
        (bad,) = map(json.loads, client.files.content(batch.error_file_id).text.splitlines())
        assert error_of(bad)["param"] == "messages.0.content.1.image_url.url"


@pytest.mark.parametrize("family", ["gemma3", "smolvlm"])
def test_serve_answers_image_messages_for_gemma3_and_smolvlm(family, tmp_path, smol_tokenizer):
    """The official client's image message through `serve` on Gemma 3 (image tokens that attend
    both ways) and SmolVLM (tiles around the image): transformers' text and prompt tokens."""
    from tests.server.conftest import serve

    hf, processor = make_tiny_vlm(family, tmp_path / family, smol_tokenizer)
    loaded = load_from_path(tmp_path / family,
                            EngineConfig.default(block_size=4, num_blocks=512, threads=1))
    with serve(loaded, tmp_path / "server") as running:
        reply = running.client().chat.completions.create(
            model=loaded.name, max_tokens=MAX_TOKENS, temperature=0, messages=[{
                "role": "user", "content": [
                    {"type": "text", "text": "What is in the picture?"},
                    {"type": "image_url", "image_url": {"url": data_url(BLUE)}}]}])
    text, prompt_tokens = expected(hf, processor, [BLUE])
    assert reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == prompt_tokens


def test_prefetch_queues_images_ahead_and_hands_out_the_first_ready_line():
    """A line waiting on a slow image holds back only itself: the next line of the window
    whose images are there goes first; `wait` returns when an image arrives."""
    import time
    from concurrent.futures import Future

    from batchrun.batch.storage.lines import InputLine
    from batchrun.batch.job.media_prefetch import Prefetch

    class Media:
        def __init__(self):
            self.futures = {}

        def start(self, url):
            return self.futures.setdefault(url, Future())

    media = Media()
    items = iter([InputLine(0, 1, line("a", "http://x/1.png")),
                  InputLine(0, 2, line("b", "http://x/2.png", "http://x/1.png")),
                  InputLine(0, 3, line("c")), InputLine(0, 4, line("d", "http://x/2.png"))])
    ahead = Prefetch(items, media, lookahead=2)
    assert not ahead.ready()  # line 1's image is on its way, and line 2's
    assert set(media.futures) == {"http://x/1.png", "http://x/2.png"}  # two lines ahead
    started = time.monotonic()
    ahead.wait(0.2)  # nothing arrives: it comes back after the slice
    assert 0.15 < time.monotonic() - started < 2
    media.futures["http://x/1.png"].set_result(RED)
    assert ahead.ready() and next(ahead).line == 1
    assert ahead.ready() and next(ahead).line == 3  # line 2 still needs 2.png: 3 goes first
    assert not ahead.ready()  # lines 2 and 4 wait for 2.png
    media.futures["http://x/2.png"].set_exception(ValueError("404"))
    assert ahead.ready()  # a failed image is ready too: the line becomes its error record
    assert [x.line for x in ahead] == [2, 4]
    # a line never passes an earlier one with its custom_id: the first duplicate runs first
    dup = iter([InputLine(0, 1, line("same", "http://x/3.png")), InputLine(0, 2, line("same")),
                InputLine(0, 3, line("other"))])
    ahead = Prefetch(dup, media, lookahead=3)
    assert next(ahead).line == 3
    assert not ahead.ready()
    media.futures["http://x/3.png"].set_result(RED)
    assert [x.line for x in ahead] == [1, 2]


def test_validate_check_prompts_renders_image_lines_through_the_processor(vlm, http_base,
                                                                          tmp_path):
    from click.testing import CliRunner

    from batchrun.batch.shell.commands import validate

    _, _, loaded = vlm
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([line("ok", data_url(RED)),
                              line("gone", f"{http_base}/never.png")]) + "\n")
    result = CliRunner().invoke(validate, [str(src), "--json", "--ignore-model-field",
                                           "--check-prompts", "--model", str(loaded.path)])
    problems = [json.loads(x) for x in result.stdout.splitlines()]
    assert [(p["custom_id"], error_of(p)["param"]) for p in problems] == [
        ("gone", "messages.0.content.1.image_url.url")], result.output


def test_parquet_flat_table_with_an_image_column(vlm, http_base, tmp_path):
    """A flat table's image column goes after the prompt text as an image part: bytes in a
    column mapped with --column image=photo, URLs in a column named image."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    hf, processor, loaded = vlm
    table = pa.table({"custom_id": ["green", "blue", "broken"],
                      "prompt": ["What is in the picture?"] * 3,
                      "photo": [png(GREEN), png(BLUE), b"not an image"],
                      "max_tokens": [MAX_TOKENS] * 3, "temperature": [0.0] * 3})
    pq.write_table(table, tmp_path / "in.parquet")
    plan = job_plan(input=str(tmp_path / "in.parquet"), output=str(tmp_path / "out.jsonl"),
                    progress="none", columns={"image": "photo"})
    run_batch(loaded, plan)
    out = {r["custom_id"]: r for r in map(json.loads, open(tmp_path / "out.jsonl"))}
    errors = {r["custom_id"]: r for r in map(json.loads, open(tmp_path / "out.errors.jsonl"))}
    for cid, img in (("green", GREEN), ("blue", BLUE)):
        body = out[cid]["response"]["body"]
        assert body["choices"][0]["message"]["content"] == expected(hf, processor, [img])[0]
    assert error_of(errors["broken"])["param"] == "messages.0.content.1.image_url.url"
    assert error_of(errors["broken"])["code"] == "invalid_image"
    strings = pa.table({"custom_id": ["u"], "prompt": ["What is in the picture?"],
                        "image": [f"{http_base}/red.png"], "max_tokens": [MAX_TOKENS],
                        "temperature": [0.0]})
    pq.write_table(strings, tmp_path / "urls.parquet")
    run_batch(loaded, job_plan(input=str(tmp_path / "urls.parquet"),
                               output=str(tmp_path / "out2.jsonl"), progress="none",
                               allow_media_host=[HOST]))
    (row,) = map(json.loads, open(tmp_path / "out2.jsonl"))
    assert row["response"]["body"]["choices"][0]["message"]["content"] == \
        expected(hf, processor, [RED])[0]


def test_a_sweep_with_an_image_column(vlm, tmp_path):
    """[dataset] image names a column whose images follow the prompt; the generations are the
    model's answers to prompt + image."""
    from batchrun.sweep.run import run_sweep
    from batchrun.sweep.spec import load

    hf, processor, loaded = vlm
    rows = [{"id": "r", "q": "What is in the picture?", "img": data_url(RED), "ref": "x"},
            {"id": "g", "q": "What is in the picture?", "img": data_url(GREEN), "ref": "y"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "s.toml").write_text(f'''name = "img"
output = "{tmp_path / 'out'}"
[dataset]
path = "{tmp_path / 'd.jsonl'}"
id = "id"
prompt = "{{{{ q }}}}"
image = "img"
reference = "ref"
[grid]
model = ["{loaded.path}"]
temperature = [0]
max_tokens = [{MAX_TOKENS}]
[[scorers]]
type = "exact_match"
''')
    spec, text = load(tmp_path / "s.toml")
    result = run_sweep(spec, text, lambda model, config: loaded)
    assert result.status == "completed"
    (generations,) = [p for p in (tmp_path / "out" / "generations").glob("*.jsonl")
                      if not p.name.endswith(".errors.jsonl")]
    answers = {r["custom_id"].split("/")[-1]: r["response"]["body"]["choices"][0]["message"]
               ["content"] for r in map(json.loads, generations.read_text().splitlines())}
    assert answers == {"r": expected(hf, processor, [RED])[0],
                       "g": expected(hf, processor, [GREEN])[0]}


def test_plan_counts_the_image_tokens_the_run_reports(vlm, tmp_path):
    """`batchrun plan`'s scan renders image lines through the processor (no weights): its
    prompt tokens are the run's usage, its prefix-cache figure keys image blocks by the image
    as the engine does (a repeated image under the same prompt hits; a different image of the
    same size, whose placeholder ids are the same, does not); its weights are the model's."""
    from batchrun import footprint
    from batchrun.batch.estimate.job_estimate import scan
    from batchrun.batch.estimate.prefix_sharing import PrefixSharing
    from batchrun.batch.estimate.throughput import WorkloadShape

    hf, _, loaded = vlm
    text = "Describe this picture in a few words, please, and say what its colours are."
    lines = [line("red", data_url(RED), text=text), line("red-again", data_url(RED), text=text),
             line("other", data_url(image(40, 30, 21)), text=text),
             line("two", data_url(GREEN), data_url(BLUE), text=text),
             line("broken", "data:image/png;base64,iVBORw0KGgo=")]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    plan = job_plan(input=str(src), output=str(tmp_path / "out.jsonl"), progress="none",
                    ignore_model_field=True, model=str(loaded.path), block_size=4,
                    num_blocks=512)
    cfg = footprint.model_config_for(str(loaded.path))
    estimate = scan(plan, footprint.tokenizer_model(str(loaded.path)), PrefixSharing(4, 512),
                    WorkloadShape(), model_config=cfg)
    run_batch(loaded, plan)
    usage = [r["response"]["body"]["usage"] for r in map(json.loads, open(tmp_path / "out.jsonl"))]
    assert (estimate.valid, estimate.invalid) == (4, 1)
    assert estimate.prompt_tokens == sum(u["prompt_tokens"] for u in usage)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    assert cached[1] > cached[2]  # the repeated image's blocks hit, the other image's do not
    assert estimate.cached_tokens == sum(cached)
    assert footprint.weights_bytes(cfg, "float32") == 4 * sum(p.numel() for p in hf.parameters())
