"""Every failure an operator can fix ends the command with one readable line on the terminal
(text logs), one `operator_error` record in JSON logs, exit status 2 for configuration, no
traceback (DEBUG keeps it) and no ANSI codes: a bad setting, a settings file that is not TOML,
an object store without the bucket, with wrong credentials or out of reach, a port in use, a
full disk, a certificate that does not load. Real `relay` processes, a real S3 server (moto,
loopback), a real tmpfs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from relay.bench.s3_server import BUCKET, moto_command, s3_server

RELAY = [sys.executable, "-m", "relay"]
ROOT = Path(__file__).resolve().parents[1]


def relay(tmp_path, *args, fmt="text", level="info", data=None,
          **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "AWS_"))}
    e.update(RELAY_LOG_FORMAT=fmt, RELAY_LOG_LEVEL=level, NO_COLOR="1",
             RELAY_CONF=str(ROOT / "conf" / "relay.toml"), **env)
    return subprocess.run([*RELAY, "--data-dir", str(data or tmp_path / "data"), *args], env=e,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def one_line(p: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The failure's line: exactly one ERROR line, the exit status, no traceback, no ANSI."""
    assert p.returncode == code, (p.returncode, p.stderr[-2000:])
    errors = [ln for ln in p.stderr.splitlines() if " ERROR " in ln or " CRIT " in ln]
    assert len(errors) == 1, p.stderr
    assert "Traceback" not in p.stderr and "\x1b" not in p.stderr + p.stdout, p.stderr
    for w in words:
        assert w in errors[0], (w, errors[0])
    return errors[0]


def as_json(p: subprocess.CompletedProcess, what: str, code: int, debug=False) -> dict:
    assert p.returncode == code, p.stderr[-2000:]
    recs = [json.loads(ln) for ln in p.stderr.splitlines()]
    bad = [r for r in recs if r["level"] in ("error", "critical")]
    assert len(bad) == 1 and bad[0]["event"] == "operator_error", recs
    assert bad[0]["what"] == what and bad[0]["exit_code"] == code
    assert ("traceback" in bad[0]) == debug   # kept at DEBUG only
    return bad[0]


def test_a_bad_setting(tmp_path):
    env = {"RELAY_PUSH__WINDOW_SECONDS": "soon"}
    line = one_line(relay(tmp_path, "status", **env), 2, "ERROR", "setting push.window_seconds "
                    "= 'soon' (from RELAY_PUSH__WINDOW_SECONDS): must be a number >= 0")
    assert line.count("\n") == 0
    rec = as_json(relay(tmp_path, "status", fmt="json", **env), "config", 2)
    assert rec["msg"].startswith("setting push.window_seconds = 'soon'")


def test_a_settings_file_that_is_not_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[trueseal\npush_port = 1\n")
    one_line(relay(tmp_path, "--conf", str(bad), "keys"), 2, f"settings file {bad} is not TOML")


@pytest.fixture(scope="module")
def s3():
    with s3_server() as endpoint:
        yield endpoint


def test_status_with_a_missing_bucket(tmp_path, s3):
    env = dict(RELAY_TABLES_DIR="s3://no-such-bucket/relay", RELAY_S3_ENDPOINT=s3,
               AWS_ACCESS_KEY_ID="relay-test", AWS_SECRET_ACCESS_KEY="relay-test-secret")
    one_line(relay(tmp_path, "status", **env), 2,
             "the object store has no such bucket (s3://no-such-bucket/relay)")
    as_json(relay(tmp_path, "status", fmt="json", **env), "bucket", 2)
    # at DEBUG the record carries its traceback, still one record
    p = relay(tmp_path, "status", level="debug", **env)
    assert p.returncode == 2 and 'File "' in p.stderr and "relay/status.py" in p.stderr


def test_status_with_an_endpoint_nobody_listens_on(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    one_line(relay(tmp_path, "status", RELAY_TABLES_DIR=f"s3://{BUCKET}/relay",
                   RELAY_S3_ENDPOINT=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="relay-test",
                   AWS_SECRET_ACCESS_KEY="relay-test-secret"), 2,
             "the object store cannot be reached")


@pytest.fixture(scope="module")
def s3_auth():
    """An S3 server that checks signatures (moto, once INITIAL_NO_AUTH_ACTION_COUNT is 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(moto_command("127.0.0.1", port),
                            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
                break
            except urllib.error.HTTPError:
                break                       # it answers (403: no credentials)
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


WRONG_SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYwrongKEY12"


def _wrong_credentials(endpoint: str) -> dict:
    """Keys the server does not know."""
    return dict(RELAY_TABLES_DIR=f"s3://{BUCKET}/relay", RELAY_S3_ENDPOINT=endpoint,
                AWS_ACCESS_KEY_ID="AKIAWRONGWRONGWRONG1", AWS_SECRET_ACCESS_KEY=WRONG_SECRET)


def test_status_with_wrong_credentials(tmp_path, s3_auth):
    env = _wrong_credentials(s3_auth)
    one_line(relay(tmp_path, "status", **env), 2, "the object store refused the credentials")
    p = relay(tmp_path, "status", fmt="json", level="debug", **env)
    as_json(p, "credentials", 2, debug=True)
    assert WRONG_SECRET not in p.stderr and WRONG_SECRET[:16] not in p.stderr


def _unreachable() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# every process a host runs: `relay up`, and each role alone
COMMANDS = [["up"], ["ingress", "--protocol", "trueseal"], ["egress"], ["stream"],
            ["compact"], ["push"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_each_process_with_a_misconfigured_object_store(tmp_path, s3, s3_auth, command):
    """A missing bucket, an endpoint nobody listens on, credentials the store refuses: each
    one line and exit status 2 (no traceback, no ANSI), from `relay up` before any role
    starts and from every role alone; never the secret."""
    ports = {f"RELAY_METRICS_PORT_{r}": "0" for r in ("INGRESS", "EGRESS", "STREAM",
                                                       "COMPACT", "PUSH")}
    cases = [
        (dict(RELAY_TABLES_DIR="s3://no-such-bucket/relay", RELAY_S3_ENDPOINT=s3,
              AWS_ACCESS_KEY_ID="relay-test", AWS_SECRET_ACCESS_KEY="relay-test-secret"),
         "the object store has no such bucket (s3://no-such-bucket/relay)"),
        (dict(RELAY_TABLES_DIR=f"s3://{BUCKET}/relay", RELAY_S3_ENDPOINT=_unreachable(),
              AWS_ACCESS_KEY_ID="relay-test", AWS_SECRET_ACCESS_KEY="relay-test-secret"),
         "the object store cannot be reached"),
        (_wrong_credentials(s3_auth), "the object store refused the credentials"),
    ]
    for i, (env, words) in enumerate(cases):
        p = relay(tmp_path, *command, data=tmp_path / f"data-{i}", **env, **ports,
                  RELAY_TRUESEAL_PUSH_PORT="0", RELAY_TRUESEAL_RECEIVE_PORT="0")
        one_line(p, 2, words)
        assert WRONG_SECRET not in p.stderr + p.stdout


def _ingress_heya(tmp_path, **env):
    return relay(tmp_path, "ingress", "--protocol", "heya", RELAY_METRICS__INGRESS_HEYA_PORT="0",
                 **env)


def test_a_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        one_line(_ingress_heya(tmp_path, RELAY_HEYA__PORT=str(port)), 2,
                 f"port {port} of this relay is in use by another process")


def test_a_certificate_that_does_not_load(tmp_path):
    pem = tmp_path / "broken.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n")
    one_line(_ingress_heya(tmp_path, RELAY_HEYA__PORT="0", RELAY_HEYA__CERT_FILE=str(pem),
                           RELAY_HEYA__KEY_FILE=str(pem)), 2,
             "a certificate or key does not load")


def test_a_full_disk(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        fd = os.open(full / "fill", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass                            # ENOSPC: full
        finally:
            os.close(fd)
        p = relay(tmp_path, "keys", data=full / "data")
        one_line(p, 1, "no space left on the device")
    finally:
        subprocess.run(["umount", str(full)], check=False)
