"""An S3-compatible server on loopback for tests and `relay bench --object-store`: moto's
server mode (PyPI, the `test` extra), in a process of its own so that our writers, not the
server, are what the measurements and races exercise. Throwaway credentials, one bucket."""

from __future__ import annotations

import os
import re
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


def moto_command(host: str, port: int) -> list[str]:
    """moto's server mode through relay.bench.moto_server (its HTTP fix), on host:port."""
    return [sys.executable, "-m", "relay.bench.moto_server", "-H", host, "-p", str(port)]


@contextmanager
def s3_server(timeout: float = 30.0, request_log=None, host: str = "127.0.0.1"):
    """Yields the endpoint URL; the bucket exists; the credentials are in os.environ (and
    restored after). `request_log` (a path): moto's log of every request goes there, one
    line each (`RequestLog` counts them). `host`: the address it listens on (a test host's,
    for roles in other network namespaces)."""
    port = _free_port()
    out = open(request_log, "ab") if request_log else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(moto_command(host, port), stdout=out, stderr=out,
                                start_new_session=True)
    finally:
        if request_log:
            out.close()
    endpoint = f"http://{host}:{port}"
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


# `127.0.0.1 - - [02/Dec/2026 05:36:41] "GET /relay-tables?list-type=2&prefix=x/ HTTP/1.1" 200 -`
_REQUEST = re.compile(r'"([A-Z]+) (\S+) HTTP/[0-9.]+"')


def request_kind(method: str, target: str) -> str:
    """What S3 bills a request as: LIST (a GET of the bucket with `list-type`), else its
    method (GET, HEAD, PUT; POST and DELETE for multipart uploads and deletes)."""
    if method == "GET" and "list-type=" in target.partition("?")[2]:
        return "LIST"
    return method


class RequestLog:
    """Counts the requests moto logged into `path` since `mark()`, by kind."""

    def __init__(self, path):
        self.path = path
        self.offset = 0

    def mark(self) -> None:
        with open(self.path, "rb") as f:
            self.offset = f.seek(0, 2)

    def requests(self) -> list[tuple[str, str]]:
        """(kind, target) of each request logged since `mark()`, in order."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            text = f.read().decode("utf-8", "replace")
        return [(request_kind(m.group(1), m.group(2)), m.group(2))
                for m in _REQUEST.finditer(text)]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind, _ in self.requests():
            out[kind] = out.get(kind, 0) + 1
        return out
