"""moto's S3 server (`python -m moto.server`) with one HTTP fix, for tests and benches.

Werkzeug's development server answers `Expect: 100-continue` twice: the standard library's
request handler sends `100 Continue` while parsing the request, and werkzeug's `run_wsgi`
sends it again. The AWS SDK for Java reads the second one as the final response (status 100)
and fails the PUT. s3a sends that header on every `copyFromLocalFile`, which is how Spark's
RocksDB state store uploads its snapshots, so none reached moto: s3a retried each for about a
minute, and a stopping stream's JVM waited on the retries (measured 2026-12-02: 27 s after its
driver had exited). Real S3 sends it once. Same arguments as `python -m moto.server`.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from moto import server
    from werkzeug.serving import WSGIRequestHandler

    # the stdlib's interim reply is the duplicate: werkzeug's own is the one kept
    WSGIRequestHandler.handle_expect_100 = lambda self: True
    server.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
