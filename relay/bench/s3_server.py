"""An S3-compatible server on loopback for tests and `relay bench --object-store`: moto's
server mode (PyPI, the `test` extra), in a process of its own so that our writers, not the
server, are what the measurements and races exercise. Throwaway credentials, one bucket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

BUCKET = "relay-tables"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "relay-test", "AWS_SECRET_ACCESS_KEY": "relay-test-secret"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def s3_server(timeout: float = 30.0):
    """Yields the endpoint URL; the bucket exists; the credentials are in os.environ (and
    restored after)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                req = urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT")
                urllib.request.urlopen(req, timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the S3 server (moto) did not start") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
