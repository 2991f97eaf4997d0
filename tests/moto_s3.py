"""A moto S3 server on loopback for tests (the real S3 API over HTTP, conditional writes
included), with the fake credentials boto needs."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
               "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


@contextlib.contextmanager
def moto_s3(bucket: str = "bkt") -> Iterator[tuple[object, dict]]:
    """(s3fs filesystem, storage_options) of a fresh server holding an empty `bucket`; the
    credentials are in os.environ while it runs (subprocesses inherit them)."""
    from moto.server import ThreadedMotoServer
    import s3fs

    old = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {"endpoint_url": f"http://{host}:{port}"}
        # Every in-process moto server shares one backend: start from, and leave, an empty one.
        _reset(options["endpoint_url"])
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        fs.mkdir(bucket)
        yield fs, options
        _reset(options["endpoint_url"])
    finally:
        server.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _reset(endpoint: str) -> None:
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"),
                           timeout=10).read()
