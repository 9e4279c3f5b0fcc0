"""Failures an operator can fix, told as one line: a bad setting, object store credentials
or bucket, an endpoint that cannot be reached, a port another process holds, a full disk, a
certificate or key that does not load. `relay` (relay/cli.py) turns such an exception into
one ERROR record, event `operator_error` (`what`, `exit_code`), and exits with its code: 2
for what the configuration must change, 1 otherwise. The traceback stays in the record at
DEBUG only (runtime/logs.py). Anything else is not explained here: it ends as an
`uncaught_exception` record, as before.

The object store's errors come as text from delta-rs (Rust, sometimes with ANSI colour codes)
or pyarrow: they are recognised by the S3 error codes in them.
"""

from __future__ import annotations

import errno
import logging
import re
import ssl
from dataclasses import dataclass

from runtime import logs
from runtime.config import ConfigError

log = logging.getLogger("relay.errors")

CONFIG = 2      # exit status: the configuration (settings, environment, files) must change
OTHER = 1


@dataclass(frozen=True)
class Failure:
    what: str        # config | credentials | bucket | endpoint | port_in_use | disk_full |
    #                  certificate | permission
    line: str
    exit_code: int


_BUCKET = re.compile(r"NoSuchBucket|NO_SUCH_BUCKET|bucket does not exist", re.I)
_CREDENTIALS = re.compile(r"InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied|"
                          r"ACCESS_DENIED|InvalidToken|ExpiredToken|InvalidClientTokenId|"
                          r"UnrecognizedClientException|Forbidden|\b403\b|"
                          r"No credentials|credentials? (?:not found|missing)", re.I)
_UNREACHABLE = re.compile(r"Connection refused|error sending request|dns error|failed to "
                          r"lookup address|Could not resolve|Couldn't connect|"
                          r"Connection reset|timed out|NETWORK_CONNECTION|CURLE_", re.I)
_ENOSPC = re.compile(r"No space left on device|ENOSPC|Disk quota exceeded", re.I)
_CERT = re.compile(r"certificate|PEM|Could not deserialize key|private key|"
                   r"key values mismatch|KEY_VALUES_MISMATCH|NO_START_LINE", re.I)
_PORT = re.compile(r"address \(['\"][^'\"]*['\"], (\d+)\)")


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _text(exc: BaseException) -> str:
    return logs.redact(" ".join(f"{type(e).__name__}: {e}" for e in _chain(exc)))


def _code(pattern: re.Pattern, text: str) -> str:
    m = pattern.search(text)
    return m.group(0) if m else ""


def explain(exc: BaseException, store: str = "") -> Failure | None:
    """The operator's line for `exc`, or None when it is not a failure of this kind. `store`
    names the object store (tables_dir) for the lines about it."""
    chain = list(_chain(exc))
    for e in chain:
        if isinstance(e, ConfigError):
            return Failure("config", str(e), CONFIG)
    for e in chain:
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            m = _PORT.search(str(e))
            port = (f"port {e.port}" if getattr(e, "port", None) else
                    f"port {m.group(1)}" if m else "a port")
            return Failure("port_in_use", f"{port} of this relay is in use by another process: "
                                          f"stop it, or move the listener in the settings "
                                          f"(docs/reference/settings.md)", CONFIG)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            where = f" writing {e.filename}" if e.filename else ""
            return Failure("disk_full", f"no space left on the device{where}: free some, or "
                                        f"move data_dir / tables_dir", OTHER)
    text = _text(exc)
    on = f" ({store})" if store else ""
    if _ENOSPC.search(text):
        return Failure("disk_full", f"no space left on the device{on}: free some, or move "
                                    f"data_dir / tables_dir", OTHER)
    if store.startswith("s3://") or "s3" in text.lower() or "bucket" in text.lower():
        if _BUCKET.search(text):
            return Failure("bucket", f"the object store has no such bucket{on}: create it, or "
                                     f"fix tables_dir", CONFIG)
        if _CREDENTIALS.search(text):
            return Failure("credentials", f"the object store refused the credentials{on} "
                                          f"({_code(_CREDENTIALS, text)}): check "
                                          f"AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                                          f"(and AWS_SESSION_TOKEN)", CONFIG)
        if _UNREACHABLE.search(text):
            return Failure("endpoint", f"the object store cannot be reached{on} "
                                       f"({_code(_UNREACHABLE, text)}): check "
                                       f"object_store.endpoint and the network", CONFIG)
    for e in chain:
        if isinstance(e, ssl.SSLError) or type(e).__module__.startswith("OpenSSL") or (
                isinstance(e, ValueError) and _CERT.search(str(e))):
            return Failure("certificate", f"a certificate or key does not load "
                                          f"({logs.redact(str(e))[:160]}): check the cert_file "
                                          f"/ key_file settings", CONFIG)
        if isinstance(e, PermissionError):
            where = f" {e.filename}" if e.filename else ""
            return Failure("permission", f"permission denied{where}: this user may not use "
                                         f"it", CONFIG)
    return None


def operator_line(exc: BaseException, store: str = "") -> str:
    """`explain`'s line, or the exception's text made safe for a log (redacted, no ANSI)."""
    failure = explain(exc, store)
    return failure.line if failure else _text(exc)[:400]


def report(failure: Failure, exc: BaseException) -> None:
    """One ERROR record (event `operator_error`); the traceback only at DEBUG."""
    debug = logging.getLogger().isEnabledFor(logging.DEBUG)
    log.error(failure.line, exc_info=exc if debug else None,
              extra={"event": "operator_error", "what": failure.what,
                     "exit_code": failure.exit_code})
