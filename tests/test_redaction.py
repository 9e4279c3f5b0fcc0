"""The one redaction step every log record passes (runtime/logs.py `RedactFilter`): planted
secrets in every spelling, URL paths and queries, credentials by name, base64 and hex runs,
ANSI escapes; what it keeps (words, paths, times, versions, hosts and statuses)."""

from __future__ import annotations

import base64
import logging
import os
import urllib.parse

import pytest

from runtime import logs


@pytest.fixture(autouse=True)
def _clean_registry():
    logs.forget_planted()
    yield
    logs.forget_planted()


def _line(name: str, msg: str, *args, **extra) -> str:
    rec = logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, None)
    rec.__dict__.update(extra)
    assert logs.RedactFilter().filter(rec) is True
    return logs.JsonFormatter("push").format(rec)


def test_a_planted_secret_is_gone_in_every_spelling():
    secret = os.urandom(32)
    logs.plant(secret)
    b64 = base64.b64encode(secret).decode()
    for spelling in logs.spellings(secret) | {b64[:-1] + "x" * 0, urllib.parse.quote(b64)}:
        line = _line("any.library", "value %s here", spelling, field=f"k={spelling}")
        assert spelling not in line and "<secret>" in line, spelling
    text = "correct-horse-battery"      # a credential with no key shape at all
    logs.plant(text)
    assert "horse" not in _line("boto", "creds %s", text)
    logs.plant("short", None, b"")     # too short to plant: ordinary words stay
    assert "short" in _line("x", "a short line")


def test_httpx_request_lines_keep_host_and_status_only():
    cap = "gAAAAABk" + base64.urlsafe_b64encode(os.urandom(96)).decode().rstrip("=")
    line = _line("httpx", 'HTTP Request: %s %s "%s %d %s"', "POST",
                 f"https://updates.push.services.mozilla.com/wpush/v2/{cap}?x=1", "HTTP/1.1",
                 201, "Created")
    assert cap[:12] not in line and "wpush" not in line
    assert 'POST https://updates.push.services.mozilla.com/... \\"HTTP/1.1 201 Created\\"' in line
    token = os.urandom(32).hex()
    line = _line("httpx", "HTTP Request: POST https://api.push.apple.com:443/3/device/%s "
                 '"HTTP/2 200 OK"', token)
    assert token not in line and "api.push.apple.com:443/..." in line and "200 OK" in line
    line = _line("urllib3.connectionpool", '%s://%s:%s "%s %s %s" %s %s', "https",
                 "oauth2.googleapis.com", 443, "POST", "/token?assertion=abc", "HTTP/1.1", 200,
                 None)
    assert "assertion" not in line and '\\"POST /... HTTP/1.1\\" 200' in line
    line = _line("relay", "endpoint ws://127.0.0.1:8780/v1/ws?token=abcdefgh")
    assert "abcdefgh" not in line and "8780" not in line


def test_credentials_named_in_text_are_gone():
    jwt = "eyJhbGciOiJFUzI1NiIsImtpZCI6IkFCQyJ9.eyJpc3MiOiJ0ZWFtIn0.c2lnbmF0dXJl"
    for text in (f"authorization: bearer {jwt}", f"Authorization: Bearer {jwt}",
                 f"access_token={jwt}", f'{{"access_token": "{jwt}", "expires_in": 3599}}',
                 "aws_secret_access_key=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                 "X-Amz-Security-Token: FwoGZXIvYXdzEBYaDHqa0AP1/5SjmLM3mG8tdA",
                 "password: hunter2hunter2"):
        line = _line("google.auth", "%s", text)
        for piece in (jwt[:20], "wJalrXUtnFEMI", "FwoGZXIvYXdz", "hunter2"):
            assert piece not in line, (text, line)
    assert "expires_in" in _line("x", '{"access_token": "abcdefgh", "expires_in": 3599}')


def test_base64_runs_go_words_paths_and_names_stay():
    key = base64.b64encode(os.urandom(32)).decode()
    assert key[:16] not in _line("delta", "key %s", key)
    for keep in ("/tmp/pytest-of-root/pytest-12/test_Foo0/data/tables/landing/node-0-ppp",
                 "stream_direct_append_off", "CommitFailedError: version 15 exists",
                 "relay-inbox-stream", "org.apache.spark.sql.execution.streaming.MicroBatchExecution",
                 "s3://relay-tables/prefix/landing", "3f2a7c1e-5d4b-4a8e-9b1c-2d3e4f5a6b7c",
                 "19:03:22.369", "log4j 2.25.4", "HTTP/1.1 201 Created"):
        assert logs.redact(keep) == keep, keep


def test_a_12_byte_token_in_hex_goes_a_long_number_stays():
    token = os.urandom(12).hex()
    assert logs.redact(f"delivery {token} refused") == "delivery <hex> refused"
    assert logs.redact("offset 123456789012345678901234") == "offset 123456789012345678901234"


def test_delta_rs_colour_codes_are_stripped():
    text = ("Generic S3 error: \x1b[1mError\x1b[0m after 0 retries: "
            "\x1b[31mInvalidAccessKeyId\x1b[0m")
    assert logs.redact(text) == "Generic S3 error: Error after 0 retries: InvalidAccessKeyId"


def test_a_child_process_line_passes_the_same_step():
    token = os.urandom(32)
    logs.plant(token)
    rec = logs.child_record('{"ts": 1, "level": "info", "logger": "org.apache.spark", '
                            f'"msg": "got {base64.b64encode(token).decode()} from 10.1.2.3"}}',
                            "stream-jvm")
    logs.RedactFilter().filter(rec)
    assert rec.getMessage() == "got <secret> from <addr>"


def test_setup_plants_the_object_store_credentials_of_the_environment(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "notAllThatSecretButLong")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.setup("test")
        assert "notAllThat" not in logs.redact("creds notAllThatSecretButLong in an error")
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
