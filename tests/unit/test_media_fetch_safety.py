"""Image fetching safe by default (openai/media.py, media_hosts.py, media_http.py): non-public
addresses refused in every spelling, the checked address is the one connected to, each redirect
hop checked again, --allow-media-host opts in, failures look alike whatever the port, are
remembered briefly only, and no fetch runs past the deadline. Loopback servers, no model."""

import io
import ipaddress
import os
import socket
import threading
import time

import pytest
from PIL import Image

from batchrun.openai import media
from batchrun.openai.media import MediaError, MediaFetcher, check_source, decode
from batchrun.openai.media_hosts import is_public
from batchrun.options.openai import OpenAIOptions
from tests.image_server import HOST, ImageServer


def png(size=(8, 6), color=(200, 10, 10), fmt="PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format=fmt)
    return out.getvalue()


@pytest.fixture(scope="module")
def server():
    with ImageServer({"/red.png": png(), "/late.png": png()}, slow={"/slow.png": 5.0}) as s:
        yield s


def fetcher(**options) -> MediaFetcher:
    options.setdefault("media_fetch_retries", 0)
    options.setdefault("media_fetch_timeout", 2.0)
    return MediaFetcher(OpenAIOptions(**options))


def refusal(url, **options) -> MediaError:
    f = fetcher(**options)
    try:
        with pytest.raises(MediaError) as e:
            f.image(url)
    finally:
        f.close()
    return e.value


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("::ffff:8.8.8.8", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False),
    ("224.0.0.1", False), ("240.0.0.1", False), ("255.255.255.255", False),
    ("::1", False), ("::", False), ("fe80::1", False), ("fc00::1", False), ("ff02::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:169.254.169.254", False),
    ("2002:7f00:1::", False), ("64:ff9b::a9fe:a9fe", False), ("::127.0.0.1", False)])
def test_which_addresses_count_as_public(address, public):
    assert is_public(ipaddress.ip_address(address)) is public


@pytest.mark.parametrize("host", [
    "2130706433", "0177.0.0.1", "0x7f.0.0.1", "0x7f000001", "127.1", "[::1]",
    "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "0.0.0.0", "0", "169.254.169.254",
    "[fe80::1]", "10.0.0.1", "[fd00::1]"])
def test_numeric_spellings_of_inside_addresses_are_refused_before_any_fetch(host, server):
    port = server.base.rsplit(":", 1)[1]
    with pytest.raises(MediaError) as e:
        check_source(f"http://{host}:{port}/red.png", OpenAIOptions())
    assert e.value.code == "media_host_not_allowed" and "--allow-media-host" in str(e.value)


def test_loopback_by_name_is_refused_unless_allowed_and_nothing_connects(server):
    port = server.base.rsplit(":", 1)[1]
    before = server.hits.get("/red.png", 0)
    for url in (f"http://localhost:{port}/red.png", f"{server.base}/red.png",
                f"HTTP://LOCALHOST:{port}/red.png"):
        assert refusal(url).code == "media_host_not_allowed"
    assert server.hits.get("/red.png", 0) == before  # refused before connecting
    for allowed in (["localhost"], [HOST], ["127.0.0.0/8"]):
        f = fetcher(allow_media_host=allowed)
        assert f.image(f"http://localhost:{port}/red.png").size == (8, 6), allowed
        f.close()
    # allowing a network does not allow another one
    assert refusal(f"{server.base}/red.png", allow_media_host=["10.0.0.0/8"]).code == \
        "media_host_not_allowed"


def test_the_address_checked_is_the_one_connected_to(server, monkeypatch):
    """A name resolved once: a second answer (DNS rebinding) is never asked for; the request
    keeps the URL's host name in its Host header."""
    port = server.base.rsplit(":", 1)[1]
    real, asked = socket.getaddrinfo, []

    def rebinding(host, *args, **kwargs):
        if host == "images.example" and not kwargs.get("flags", 0) & socket.AI_NUMERICHOST:
            asked.append(host)  # first answer: the allowed server; any later one: elsewhere
            host = HOST if len(asked) == 1 else "10.9.9.9"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    f = fetcher(allow_media_host=[f"{HOST}/32"])
    assert f.image(f"http://images.example:{port}/red.png").size == (8, 6)
    f.close()
    assert asked == ["images.example"]
    assert server.host_headers[-1] == f"images.example:{port}"


def test_every_redirect_hop_is_checked(server):
    """An allowed host redirecting to an address that is not allowed: refused at that hop."""
    port = server.base.rsplit(":", 1)[1]
    server.redirects.update({"/to-inside": f"http://127.0.0.1:{port}/red.png",
                             "/to-metadata": "http://169.254.169.254/latest/meta-data/",
                             "/loop": "/loop", "/relative": "/red.png"})
    allowed = dict(allow_media_host=["localhost"])  # by name: 127.0.0.1 itself is not allowed
    for path in ("/to-inside", "/to-metadata"):
        assert refusal(f"http://localhost:{port}{path}", **allowed).code == \
            "media_host_not_allowed", path
    assert "redirects" in str(refusal(f"http://localhost:{port}/loop", **allowed))
    f = fetcher(**allowed)
    assert f.image(f"http://localhost:{port}/relative").size == (8, 6)
    f.close()


def test_a_refused_closed_or_silent_port_reads_the_same():
    """Nothing tells a port scan which ports are open: a closed port, one that speaks no HTTP
    and one that never answers give the same message."""
    closed = socket.socket()
    closed.bind((HOST, 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    garbage, silent = socket.socket(), socket.socket()
    for s in (garbage, silent):
        s.bind((HOST, 0))
        s.listen(4)

    def speak_garbage():
        conn, _ = garbage.accept()
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
        conn.close()

    threading.Thread(target=speak_garbage, daemon=True).start()
    messages = {port: str(refusal(f"http://{HOST}:{port}/x.png", allow_media_host=[HOST],
                                  media_fetch_timeout=0.5))
                for port in (closed_port, garbage.getsockname()[1], silent.getsockname()[1])}
    garbage.close()
    silent.close()
    assert len(set(messages.values())) == 1, messages
    assert "could not be reached" in next(iter(messages.values()))


def test_a_failed_fetch_is_retried_once_its_failure_is_old(server, monkeypatch):
    monkeypatch.setattr(media, "FAILURE_TTL", 0.3)
    f = fetcher(allow_media_host=[HOST])
    url = f"{server.base}/recovers.png"
    for _ in range(2):  # remembered: one request for both
        with pytest.raises(MediaError):
            f.image(url)
    assert server.hits["/recovers.png"] == 1
    server.routes["/recovers.png"] = png()
    time.sleep(0.4)
    assert f.image(url).size == (8, 6)  # the host recovered: fetched again
    assert server.hits["/recovers.png"] == 2
    f.close()


def test_no_fetch_or_retry_runs_past_the_deadline(server):
    f = fetcher(allow_media_host=[HOST], media_fetch_timeout=10.0, media_fetch_retries=2)
    f.deadline = time.time() + 0.5
    started = time.monotonic()
    with pytest.raises(MediaError) as e:
        f.image(f"{server.base}/slow.png")
    assert time.monotonic() - started < 2.5 and e.value.code == "image_fetch_failed"
    f.close()


def test_other_protocols_are_refused():
    for url in ("ftp://127.0.0.1/x.png", "sftp://host/x.png", "gopher://127.0.0.1:25/_x"):
        with pytest.raises(MediaError) as e:
            check_source(url, OpenAIOptions())
        assert e.value.code == "invalid_value", url


def test_local_files_encoded_dots_folders_and_fifos_are_clean_errors(tmp_path):
    allowed = tmp_path / "media"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "ok.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png())
    os.mkfifo(allowed / "pipe.png")
    f = fetcher(allowed_media_path=str(allowed))
    assert f.image(f"file://{allowed}/ok.png").size == (8, 6)
    cases = {f"file://{allowed}/%2e%2e/secret.png": "media_path_not_allowed",
             f"file://{allowed}/sub/%2E%2E/%2e%2e/secret.png": "media_path_not_allowed",
             str(allowed / "sub"): "invalid_value", f"file://{allowed}/sub/": "invalid_value",
             str(allowed / "pipe.png"): "invalid_value",
             str(allowed / "absent.png"): "image_fetch_failed"}
    for url, code in cases.items():
        with pytest.raises(MediaError) as e:
            f.image(url)
        assert e.value.code == code, (url, e.value)
    f.close()


def test_a_truncated_jpeg_is_an_invalid_image_at_every_length():
    data = png((64, 48), fmt="JPEG")
    for n in range(1, len(data), 5):
        with pytest.raises(MediaError) as e:
            decode(data[:n], 10**6)
        assert e.value.code == "invalid_image", n


def test_allow_media_host_entries_are_checked_in_the_option():
    from pydantic import ValidationError

    assert OpenAIOptions(allow_media_host=("Images.Local", "10.0.0.0/8", "::1")) \
        .allow_media_host == ["images.local", "10.0.0.0/8", "::1"]
    for bad in (["a b"], ["10.0.0.0/99"], ["http://x/"]):
        with pytest.raises(ValidationError):
            OpenAIOptions(allow_media_host=bad)


def test_allow_media_host_reaches_run_job_specs_and_serve(tmp_path):
    from click.testing import CliRunner

    from batchrun.batch.shell.jobspec import load
    from batchrun.cli import main

    (tmp_path / "in.jsonl").write_text("")
    (tmp_path / "job.toml").write_text(
        'input = "in.jsonl"\noutput = "out.jsonl"\nallow_media_host = ["127.0.0.1", "cdn.local"]\n')
    assert load(str(tmp_path / "job.toml")).openai.allow_media_host == ["127.0.0.1", "cdn.local"]
    (tmp_path / "bad.toml").write_text('input = "in.jsonl"\nallow_media_host = ["a b"]\n')
    with pytest.raises(ValueError, match="allow_media_host"):
        load(str(tmp_path / "bad.toml"))
    for command in ("run", "serve", "validate"):
        result = CliRunner().invoke(main, [command, "--help"])
        assert "--allow-media-host HOST|CIDR" in result.output, command
