"""The Heya listener over real TLS 1.3 on loopback, with per-test client certificates.

Every line is built byte by byte from the README (003) and heya-interop.md. No Spark here:
where a test needs messages in the inbox it appends inbox rows the way the stream would
(protocol "heya", mailbox = send token, cursor = seq); tests/test_heya_end_to_end.py runs the
same through the real stream.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import hmac
import logging
import os
import socket
import ssl
import time
from contextlib import asynccontextmanager
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand
from deltalake import DeltaTable, write_deltalake

from delta_tables.layout import Layout
from delta_tables.schema import C, INBOX
from delta_tables.heya_control import mint_inbox_tokens
from ingress.service import IngressNode

from heya_client import Cert, HeyaClient, client_context, recv_line, send_line

END = 2220385707   # the upstream tests' end time (2040)


@asynccontextmanager
async def node(settings, **heya):
    for k, v in heya.items():
        setattr(settings.heya, k, v)
    n = IngressNode(settings, fsync=False)
    await n.start()
    try:
        yield n
    finally:
        await n.close()


def mint(settings, count=1) -> list[bytes]:
    return mint_inbox_tokens(Layout.of(settings), count, fsync=False)


async def mailbox(port, cert, inbox_token) -> HeyaClient:
    c = await HeyaClient.connect(port, cert)
    c.send(b"INCO " + inbox_token.hex().encode() + b"\n")
    await c.expect(b"INCO " + inbox_token.hex().encode() + b"\n")
    return c


async def auth(c: HeyaClient, start=0, end=END) -> bytes:
    c.send(b"AUTH %d %d\n" % (start, end))
    await c.expect(b"AUTH ")
    token_hex = await c.read_exact(64)
    await c.expect(b" %d %d\n" % (start, end))
    return token_hex


_seq = iter(range(1_000_000, 2_000_000))


def land_inbox(settings, token: bytes, bodies: list[bytes], first_cursor: int) -> None:
    """Append inbox rows as the stream commits them (one WRITE commit)."""
    now = datetime.now(timezone.utc)
    rows = [{
        C.EVENT_ID: hashlib.blake2b(token + b, digest_size=32).digest(), C.PROTOCOL: "heya",
        C.MAILBOX: token, C.ENVELOPE: b, C.META: None, C.RECEIVED_AT: now,
        C.EXPIRES_AT: now + timedelta(days=1), C.CURSOR: first_cursor + i, C.SEQ: next(_seq),
        C.COMMITTED_AT: now, C.LANDING_TABLE: "node-t/g000001", C.LANDING_VERSION: 1,
        C.BATCH_ID: 0} for i, b in enumerate(bodies)]
    write_deltalake(str(Layout.of(settings).inbox),
                    pa.Table.from_pylist(rows, schema=INBOX.arrow_schema()), mode="append")


async def no_connections(n, timeout=10.0) -> None:
    """Every connection the test opened has been closed by the server (no leak)."""
    deadline = time.monotonic() + timeout
    while n.heya.connections:
        assert time.monotonic() < deadline, f"{n.heya.connections} connections still open"
        await asyncio.sleep(0.05)


def landing_rows(settings) -> list[dict]:
    out = []
    for path in Layout.of(settings).landing_tables().values():
        out += DeltaTable(str(path)).to_pyarrow_table().to_pylist()
    return out


# --- control commands ---------------------------------------------------------------------------

def test_inbox_tokens_auth_list_extd_deau_push_tokens_dall(settings, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="relay")
    asyncio.run(_control(settings, tmp_path))
    text = caplog.text
    for secret in _SECRETS:
        assert secret not in text, "a token, digest or push token reached the logs"


_SECRETS: list[str] = []


async def _control(settings, tmp_path):
    inbox_token, spare = mint(settings, 2)
    alice, mallory = Cert(tmp_path, "alice"), Cert(tmp_path, "mallory")
    async with node(settings) as n:
        port = n.heya.bound_port
        # An unknown inbox token closes the connection (README "INCO"); nothing is consumed.
        c = await HeyaClient.connect(port, alice)
        c.send(b"INCO " + b"ee" * 32 + b"\n")
        assert await c.closed_by_server()

        a = await mailbox(port, alice, inbox_token)
        t1 = await auth(a, 0, END)
        t2 = await auth(a, 1, END + 1)
        t0 = await auth(a, 0, END - 1)
        a.send(b"LIST\n")   # ordered by start, end, token; next_seq 0 (interop §3 LIST)
        await a.expect(b"LIST 3\n" + t0 + b" 0 0 %d\n" % (END - 1) + t1 + b" 0 0 %d\n" % END
                       + t2 + b" 0 1 %d\n" % (END + 1))
        a.send(b"EXTD " + t1 + b" 1000\n")               # old end + seconds (interop §3)
        await a.expect(b"EXTD " + t1 + b" %d\n" % (END + 1000))
        a.send(b"DEAU " + t2 + b"\nLIST\n")
        await a.expect(b"DEAU " + t2 + b"\nLIST 2\n" + t0 + b" 0 0 %d\n" % (END - 1)
                       + t1 + b" 0 0 %d\n" % (END + 1000))
        dev1, dev2 = b"1234567812345678123456781234567812345678123456781234567812345678", b"x"
        a.send(b"IOSA " + dev1 + b"\nIOSA " + dev2 + b"\nIOSA " + dev1 + b"\nIOSD " + dev2
               + b"\nIOSL\nPING\n")
        await a.expect(b"IOSA " + dev1 + b"\nIOSA " + dev2 + b"\nIOSA " + dev1 + b"\nIOSD "
                       + dev2 + b"\nIOSL 1\n" + dev1 + b" ")
        registered = int((await a.read_line()).strip())
        assert abs(registered - time.time()) < 60
        await a.expect(b"PONG\n")

        # The inbox token was single use; a second certificate cannot take it.
        m = await HeyaClient.connect(port, mallory)
        m.send(b"INCO " + inbox_token.hex().encode() + b"\n")
        assert await m.closed_by_server()
        # Someone else's send token: DEAU / EXTD / TRIM close; LIST is empty; WANT is GONE.
        for line in (b"DEAU " + t1 + b"\n", b"EXTD " + t1 + b" 5\n", b"TRIM " + t1 + b" 0\n"):
            m = await mailbox(port, mallory, spare) if line.startswith(b"DEAU") else \
                await HeyaClient.connect(port, mallory, greeting=b"HEYA 0\nDONE\n")
            m.send(line)
            assert await m.closed_by_server()
        m = await HeyaClient.connect(port, mallory)
        m.send(b"LIST\nWANT " + t1 + b" 0\n")
        await m.expect(b"LIST 0\nGONE " + t1 + b" 0\n")
        m.close()

        # AUTH with end before start or in the past is refused (interop §5.1).
        for line in (b"AUTH 10 5\n", b"AUTH 0 100\n"):
            a2 = await HeyaClient.connect(port, alice, greeting=None)
            await a2.read_line()                     # HEYA 0
            while (await a2.read_line()) != b"DONE\n":
                pass
            a2.send(line)
            assert await a2.closed_by_server()

        # A reconnect announces LAST per token; DALL then removes everything.
        a.close()
        a = await HeyaClient.connect(port, alice, greeting=b"HEYA 0\nLAST " + t0 + b" 0\nLAST "
                                     + t1 + b" 0\nDONE\n")
        a.send(b"DALL\nLIST\nPING\n")              # connection stays usable (interop §3 DALL)
        await a.expect(b"DALL\nLIST 0\nPONG\n")
        a.send(b"IOSL\n")                           # no longer a mailbox: closes
        assert await a.closed_by_server()
        a = await HeyaClient.connect(port, alice)   # no LAST lines any more
        a.send(b"SEND " + t1 + b" " + hashlib.sha256(b"x").hexdigest().encode() + b" 1\nx\n")
        assert await a.closed_by_server()           # revoked by DALL
        _SECRETS.extend([inbox_token.hex(), t1.decode(), alice.digest.hex(), dev1.decode()])


# --- SEND ---------------------------------------------------------------------------------------

def test_send_is_answered_after_the_landing_commit_and_seqs_come_from_the_inbox(settings,
                                                                                 tmp_path):
    asyncio.run(_send(settings, tmp_path))


async def _send(settings, tmp_path):
    (inbox_token,) = mint(settings)
    alice, bob = Cert(tmp_path, "alice"), Cert(tmp_path, "bob")
    async with node(settings) as n:
        port = n.heya.bound_port
        a = await mailbox(port, alice, inbox_token)
        t_hex = await auth(a)
        token = bytes.fromhex(t_hex.decode())
        b = await HeyaClient.connect(port, bob)
        bodies = [b"hello", b"there", b"maxi"]
        b.send(b"".join(send_line(t_hex.upper(), x) for x in bodies))   # pipelined, any case
        for x in bodies:
            await b.expect(recv_line(x))
        # RECV means the landing commit returned: all three rows are in landing already.
        landed = [r for r in landing_rows(settings) if r[C.MAILBOX] == token]
        assert sorted(r[C.ENVELOPE] for r in landed) == sorted(bodies)
        assert {r[C.PROTOCOL] for r in landed} == {"heya"}
        assert len({r[C.EVENT_ID] for r in landed}) == 3
        # Two identical SENDs are two messages (interop §3 SEND): distinct event ids.
        b.send(send_line(t_hex, b"hello"))
        await b.expect(recv_line(b"hello"))
        landed = [r for r in landing_rows(settings) if r[C.MAILBOX] == token]
        assert len({r[C.EVENT_ID] for r in landed}) == 4

        # The stream commits seqs 0..2 (simulated): one HAVE per message, newest seq + 1.
        land_inbox(settings, token, bodies, 0)
        await a.expect(b"HAVE " + t_hex + b" 1\nHAVE " + t_hex + b" 2\nHAVE " + t_hex
                       + b" 3\n")
        a.send(b"WANT " + t_hex + b" 0\nWANT " + t_hex.upper() + b" 2\nWANT " + t_hex
               + b" 3\n")
        await a.expect(b"GIVE " + t_hex + b" 0 5\nhello\nGIVE " + t_hex + b" 2 4\nmaxi\nGONE "
                       + t_hex + b" 3\n")
        # TRIM is scoped to its token and inclusive; the count is what it removed.
        t2_hex = await auth(a)
        land_inbox(settings, bytes.fromhex(t2_hex.decode()), [b"other"], 0)
        await a.expect(b"HAVE " + t2_hex + b" 1\n")
        a.send(b"TRIM " + t_hex + b" 1\nTRIM " + t_hex + b" 1\nWANT " + t_hex + b" 1\nWANT "
               + t_hex + b" 2\nWANT " + t2_hex + b" 0\nTRIM " + t_hex + b" 99\n")
        await a.expect(b"TRIM " + t_hex + b" 1 2\nTRIM " + t_hex + b" 1 0\nGONE " + t_hex
                       + b" 1\nGIVE " + t_hex + b" 2 4\nmaxi\nGIVE " + t2_hex + b" 0 5\nother\n"
                       + b"TRIM " + t_hex + b" 99 1\n")
        # A second session of the same certificate gets LAST (TRIM does not lower next_seq)
        # and the HAVEs that follow, as does the first one.
        last = sorted([(t_hex, 3), (t2_hex, 1)])          # same start and end: by token
        a2 = await HeyaClient.connect(port, alice, greeting=b"HEYA 0\n" + b"".join(
            b"LAST %s %d\n" % kv for kv in last) + b"DONE\n")
        land_inbox(settings, token, [b"fourth"], 3)
        for c in (a, a2):
            await c.expect(b"HAVE " + t_hex + b" 4\n")
        a2.send(b"WANT " + t_hex + b" 3\nQUIT\n")
        await a2.expect(b"GIVE " + t_hex + b" 3 6\nfourth\n")
        assert await a2.closed_by_server()
        # Bodies not in memory are read back from the inbox table.
        n.heya.inbox._cache.clear()
        a.send(b"WANT " + t_hex + b" 3\n")
        await a.expect(b"GIVE " + t_hex + b" 3 6\nfourth\n")
        assert n.heya.inbox.disk_reads >= 1
        b.close()
        a.close()


def test_send_refused_outside_its_token_times_and_when_revoked(settings, tmp_path):
    asyncio.run(_times(settings, tmp_path))


async def _times(settings, tmp_path):
    (inbox_token,) = mint(settings)
    alice, bob = Cert(tmp_path, "alice"), Cert(tmp_path, "bob")
    async with node(settings) as n:
        port = n.heya.bound_port
        now = int(time.time())
        a = await mailbox(port, alice, inbox_token)
        later = await auth(a, now + 3600, now + 7200)     # not valid yet
        short = await auth(a, 0, now + 60)                # valid for a minute
        for t_hex in (later, short):
            b = await HeyaClient.connect(port, bob)
            b.send(send_line(t_hex, b"x"))
            if t_hex is short:
                await b.expect(recv_line(b"x"))
                n.heya.clock = lambda: time.time() + 120  # a minute past its end
                b.send(send_line(t_hex, b"y"))
            assert await b.closed_by_server()
        n.heya.clock = time.time
        a.send(b"EXTD " + short + b" 3600\n")              # extended: valid again
        await a.expect(b"EXTD " + short + b" %d\n" % (now + 3660))
        n.heya.clock = lambda: time.time() + 120
        b = await HeyaClient.connect(port, bob)
        b.send(send_line(short, b"z"))
        await b.expect(recv_line(b"z"))
        a.send(b"DEAU " + short + b"\n")
        await a.expect(b"DEAU " + short + b"\n")
        b.send(send_line(short, b"zz"))
        assert await b.closed_by_server()
        assert sorted(r[C.ENVELOPE] for r in landing_rows(settings)) == [b"x", b"z"]


# --- malformed input, limits, timeouts -----------------------------------------------------------

BAD = [
    b"ping\n", b"PING \n", b"HELO\n", b"LIST\r\n",
    b"INCO " + b"zz" * 32 + b"\n",
    b"AUTH 1 12345678901\n",
    b"WANT " + b"ab" * 32 + b"  1\n",
    b"IOSA " + b"a" * 65 + b"\n",
    b"SEND " + b"ab" * 32 + b" " + hashlib.sha256(b"hello").hexdigest().encode()
    + b" 5\nhello!",                                         # no \n after the body
    b"SEND " + b"ab" * 32 + b" " + hashlib.sha256(b"hello").hexdigest().encode()
    + b" 5\nhellO\n",                                        # wrong digest
]


def test_malformed_commands_wrong_digest_and_oversize_close_and_store_nothing(settings,
                                                                              tmp_path):
    asyncio.run(_malformed(settings, tmp_path))


async def _malformed(settings, tmp_path):
    (inbox_token,) = mint(settings)
    alice, bob = Cert(tmp_path, "alice"), Cert(tmp_path, "bob")
    async with node(settings, max_body=1000) as n:
        port = n.heya.bound_port
        fds = len(os.listdir("/proc/self/fd"))
        a = await mailbox(port, alice, inbox_token)
        t_hex = await auth(a)
        for bad in BAD + [
                send_line(t_hex, b"hello")[:-1] + b"X",
                b"SEND " + t_hex + b" " + hashlib.sha256(b"hello").hexdigest().encode()
                + b" 5\nhellO\n"]:
            b = await HeyaClient.connect(port, bob)
            b.send(b"PING\n" + bad + b"PING\n")       # the reply before it still comes
            await b.expect(b"PONG\n")
            assert await b.closed_by_server(), bad
            b.close()
        # Oversize: closed as soon as the header is complete, before any body byte.
        b = await HeyaClient.connect(port, bob)
        b.send(b"SEND " + t_hex + b" " + b"00" * 32 + b" 1001\n")
        assert await b.closed_by_server()
        b.close()
        b = await HeyaClient.connect(port, bob)
        body = b"x" * 1000                               # exactly the cap: fine
        b.send(send_line(t_hex, body))
        await b.expect(recv_line(body))
        assert [r[C.ENVELOPE] for r in landing_rows(settings)] == [body]
        assert n.heya.rejected["digest_mismatch"] == 2 and n.heya.rejected["oversize"] == 1
        a.close()
        b.close()
        await no_connections(n)
        # No descriptor leak (the public server leaves such sockets in CLOSE-WAIT, §0).
        deadline = time.monotonic() + 10
        while len(os.listdir("/proc/self/fd")) > fds + 6:   # 15 connections were opened
            assert time.monotonic() < deadline, "file descriptors leaked"
            await asyncio.sleep(0.1)


def test_tls_requires_1_3_and_a_client_certificate(settings, tmp_path):
    async def go():
        async with node(settings) as n:
            port = n.heya.bound_port
            c = await HeyaClient.connect(port, None, greeting=None)   # no certificate
            assert await c.closed_by_server()
            with pytest.raises((ssl.SSLError, ConnectionError)):
                await HeyaClient.connect(port, Cert(tmp_path, "old"),
                                         max_version=ssl.TLSVersion.TLSv1_2)
            # A renewed certificate (same key) is another mailbox: no LAST, AUTH refused.
            (inbox_token,) = mint(settings)
            alice = Cert(tmp_path, "alice")
            a = await mailbox(port, alice, inbox_token)
            t_hex = await auth(a)
            a.close()
            await HeyaClient.connect(port, alice, greeting=b"HEYA 0\nLAST " + t_hex
                                     + b" 0\nDONE\n")
            renewed = await HeyaClient.connect(port, alice.renewed(tmp_path, "alice2"))
            renewed.send(b"AUTH 0 %d\n" % END)
            assert await renewed.closed_by_server()
    asyncio.run(go())


def test_idle_and_slow_commands_time_out(settings, tmp_path):
    async def go():
        async with node(settings, idle_timeout_seconds=0.5, command_timeout_seconds=0.5,
                        min_body_bytes_per_second=1000) as n:
            port = n.heya.bound_port
            bob = Cert(tmp_path, "bob")
            idle = await HeyaClient.connect(port, bob)
            t0 = time.monotonic()
            assert await idle.closed_by_server(timeout=5)
            assert 0.4 < time.monotonic() - t0 < 3
            pinger = await HeyaClient.connect(port, bob)     # pings keep a connection open
            for _ in range(4):
                await asyncio.sleep(0.3)
                pinger.send(b"PING\n")
                await pinger.expect(b"PONG\n")
            slow = await HeyaClient.connect(port, bob)
            slow.send(b"PIN")                              # a command that never completes
            assert await slow.closed_by_server(timeout=5)
            # A body gets its length / rate on top: 2000 bytes at >= 1000 B/s -> 2.5 s.
            body = b"y" * 2000
            line = send_line(b"ab" * 32, body)
            slow = await HeyaClient.connect(port, bob)
            slow.send(line[:200])
            await asyncio.sleep(1.0)
            slow.send(line[200:1200])
            assert not await slow.closed_by_server(timeout=0.5)
            assert await slow.closed_by_server(timeout=5)  # never finished
            assert n.heya.rejected["idle_timeout"] >= 1
            assert n.heya.rejected["command_timeout"] >= 2
            pinger.close()
    asyncio.run(go())


def test_a_stalled_reader_is_closed_and_stalls_nobody_else(settings, tmp_path):
    asyncio.run(_stalled(settings, tmp_path))


async def _stalled(settings, tmp_path):
    (inbox_token,) = mint(settings)
    alice, bob = Cert(tmp_path, "alice"), Cert(tmp_path, "bob")
    async with node(settings, write_timeout_seconds=1.0, idle_timeout_seconds=30) as n:
        port = n.heya.bound_port
        a = await mailbox(port, alice, inbox_token)
        t_hex = await auth(a)
        big = bytes(200_000)
        land_inbox(settings, bytes.fromhex(t_hex.decode()), [big], 0)
        await a.expect(b"HAVE " + t_hex + b" 1\n")
        # `a` asks for 200 MB of GIVEs and never reads them.
        a.send((b"WANT " + t_hex + b" 0\n") * 1000)
        b = await HeyaClient.connect(port, bob)
        t0 = time.monotonic()
        for _ in range(20):                 # meanwhile another client is served at once
            b.send(b"PING\n")
            await b.expect(b"PONG\n", timeout=1.0)
        assert time.monotonic() - t0 < 2.0
        deadline = time.monotonic() + 15
        while n.heya.rejected["write_timeout"] == 0:
            assert time.monotonic() < deadline, "the stalled reader was never closed"
            await asyncio.sleep(0.1)
        b.send(b"PING\n")
        await b.expect(b"PONG\n", timeout=1.0)
        b.close()
        a.writer.transport.abort()
        await no_connections(n)


def test_operator_mints_inbox_tokens_with_the_cli_while_the_node_runs(settings, tmp_path):
    """`relay heya inbox-token` prints tokens; the running node accepts them at the next INCO
    without a restart. `RELAY_HEYA_PORT` moves the listener."""
    import os
    import subprocess
    import sys
    from runtime import config
    assert config.load(None, env={"RELAY_HEYA_PORT": "18337"}).heya.port == 18337

    async def go():
        async with node(settings) as n:
            out = await asyncio.to_thread(subprocess.run, [
                sys.executable, "-m", "relay.cli", "--data-dir", settings.data_dir, "heya",
                "inbox-token", "--count", "2"], capture_output=True, text=True, check=True,
                env=dict(os.environ, RELAY_CONF=os.devnull))
            tokens = out.stdout.split()
            assert len(tokens) == 2 and all(len(t) == 64 for t in tokens)
            a = await mailbox(n.heya.bound_port, Cert(tmp_path, "alice"),
                              bytes.fromhex(tokens[1]))
            a.close()
    asyncio.run(go())


# --- TLS: any client certificate, key possession proven (runtime/tls.py, runtime/tls_stream.py) ------

def test_any_client_certificate_is_accepted_and_its_der_digest_is_the_identity(settings,
                                                                               tmp_path):
    """Go's RequireAnyClientCert (interop §1): self-signed, expired, not yet valid, or issued
    by a CA nobody knows, each certificate is a mailbox named by SHA-256 of its DER."""
    async def go():
        ca = Cert(tmp_path, "unknown-ca")
        certs = [Cert(tmp_path, "self-signed"),
                 Cert(tmp_path, "expired", valid=(timedelta(days=-30), timedelta(days=-1))),
                 Cert(tmp_path, "not-yet-valid", valid=(timedelta(days=1), timedelta(days=30))),
                 Cert(tmp_path, "unknown-issuer", issuer=ca)]
        async with node(settings) as n:
            port = n.heya.bound_port
            for cert, inbox_token in zip(certs, mint(settings, len(certs))):
                c = await mailbox(port, cert, inbox_token)
                assert [s.owner for s in n.heya.inbox.sessions_of(cert.digest)] == [cert.digest]
                assert n.heya.control.is_mailbox(cert.digest)
                c.close()
            assert n.heya.rejected["tls_handshake"] == 0
            await no_connections(n)
    asyncio.run(go())


_LOG_RECORD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def test_tls_failures_close_quietly_and_are_counted(settings, tmp_path, caplog):
    """No certificate, TLS 1.2, not TLS at all: closed with the alert TLS owes, counted, and
    logged without a traceback, a client address or port."""
    caplog.set_level(logging.DEBUG)
    loop_errors: list[dict] = []
    client_ports: list[int] = []

    async def go():
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
        async with node(settings) as n:
            port = n.heya.bound_port
            # TLS 1.3 clients finish first; the refusal comes as an alert on their first read.
            c = await HeyaClient.connect(port, None, greeting=None)
            client_ports.append(c.writer.get_extra_info("sockname")[1])
            with pytest.raises(ssl.SSLError, match="CERTIFICATE_REQUIRED"):
                await c.read_exact(1)
            c.close()
            with pytest.raises(ssl.SSLError, match="PROTOCOL_VERSION"):   # interop §1
                await HeyaClient.connect(port, Cert(tmp_path, "old"),
                                         max_version=ssl.TLSVersion.TLSv1_2)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            client_ports.append(writer.get_extra_info("sockname")[1])
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                await asyncio.wait_for(reader.read(), 5)   # to EOF: the server closed
            except ConnectionError:
                pass
            writer.close()
            await no_connections(n)
            assert n.heya.rejected["tls_handshake"] == 3
            assert n.heya.accepted == 0
            # The listener still serves.
            (await HeyaClient.connect(port, Cert(tmp_path, "fine"))).close()
    asyncio.run(go())
    assert not loop_errors, loop_errors
    failed = [r for r in caplog.records if getattr(r, "reason", None) == "tls"]
    assert len(failed) == 3
    for rec in caplog.records:
        assert rec.exc_info is None and "Traceback" not in rec.getMessage(), rec
        said = rec.getMessage() + repr({k: v for k, v in vars(rec).items()
                                        if k not in _LOG_RECORD_FIELDS})
        assert "127.0.0.1" not in said, said
        assert not any(str(p) in said for p in client_ports), said


def test_a_client_that_never_finishes_its_handshake_is_closed_at_the_deadline(settings,
                                                                              tmp_path):
    async def go():
        async with node(settings, handshake_timeout_seconds=0.5) as n:
            port = n.heya.bound_port
            silent = HeyaClient(*await asyncio.open_connection("127.0.0.1", port))
            ctx = client_context(Cert(tmp_path, "slow"))
            hello = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO())
            with pytest.raises(ssl.SSLWantReadError):
                hello.do_handshake()
            client_hello = out.read()
            halfway = HeyaClient(*await asyncio.open_connection("127.0.0.1", port))
            halfway.send(client_hello[:len(client_hello) // 2])
            t0 = time.monotonic()
            assert not await silent.closed_by_server(timeout=0.2)
            assert n.heya.connections == 0   # a handshake is not a session yet
            assert await silent.closed_by_server(timeout=5)
            assert await halfway.closed_by_server(timeout=5)
            assert 0.25 < time.monotonic() - t0 < 3
            assert n.heya.rejected["handshake_timeout"] == 2
            # Nothing of them is left: no stream, no OpenSSL connection.
            deadline = time.monotonic() + 5
            while _tls_objects():
                assert time.monotonic() < deadline, _tls_objects()
                await asyncio.sleep(0.05)
            # A client within the deadline is served as usual.
            (await HeyaClient.connect(port, Cert(tmp_path, "quick"))).close()
    asyncio.run(go())


def _tls_objects() -> list:
    from OpenSSL import SSL
    from runtime.tls_stream import TLSStream
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, (TLSStream, SSL.Connection))]


def test_a_resumed_session_keeps_its_certificate_identity(settings, tmp_path):
    """TLS 1.3 resumption (the server names its session context): the resumed connection
    is the same mailbox, LAST lines included."""
    async def go():
        (inbox_token,) = mint(settings)
        alice = Cert(tmp_path, "alice")
        async with node(settings) as n:
            port = n.heya.bound_port
            a = await mailbox(port, alice, inbox_token)
            t_hex = await auth(a)
            a.close()

            def two_connections():
                ctx = client_context(alice)
                greetings, session = [], None
                for _ in range(2):
                    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), 10),
                                         session=session) as s:
                        got = b""
                        while not got.endswith(b"DONE\n"):
                            got += s.recv(4096)
                        greetings.append((got, s.session_reused))
                        session = s.session
                return greetings
            first, second = await asyncio.to_thread(two_connections)
            greeting = b"HEYA 0\nLAST " + t_hex + b" 0\nDONE\n"
            assert first == (greeting, False)
            assert second == (greeting, True)
    asyncio.run(go())


def test_a_certificate_without_its_key_cannot_complete_the_handshake(settings, tmp_path,
                                                                      caplog):
    """Key possession is still proven: the client's CertificateVerify, re-signed in flight by
    another key (Finished recomputed to match), fails the handshake; re-signed by the
    certificate's own key, the same forgery passes (so the forger itself is sound)."""
    caplog.set_level(logging.DEBUG, logger="relay")

    async def go():
        alice = Cert(tmp_path, "alice")
        mallory_key = ec.generate_private_key(ec.SECP256R1())
        async with node(settings) as n:
            port = n.heya.bound_port
            got = await _resigned_handshake(port, alice, alice.key_obj, tmp_path / "k1")
            assert got == b"HEYA 0\nDONE\n"
            with pytest.raises(ssl.SSLError, match="DECRYPT_ERROR"):
                await _resigned_handshake(port, alice, mallory_key, tmp_path / "k2")
            assert n.heya.rejected["tls_handshake"] == 1
            await no_connections(n)
            assert not n.heya.inbox.sessions_of(alice.digest)
    asyncio.run(go())
    (failed,) = [r for r in caplog.records if getattr(r, "reason", None) == "tls"]
    assert "signature" in failed.detail   # OpenSSL: "bad signature"


def test_tls_stream_stops_reading_for_a_slow_application_and_ends_with_close_notify(tmp_path):
    """runtime/tls_stream.py on its own: decrypted bytes the application has not read stay
    under the bound (the socket is not read meanwhile), 32 MiB each way arrive intact, and
    close() is a clean EOF for the client (close_notify), not a reset."""
    from runtime import tls, tls_stream

    async def go():
        cert, key = tls.load_or_create_server_cert(tmp_path / "data")
        blob = os.urandom(32 << 20)
        release, streams = asyncio.Event(), []

        async def handler(reader, writer):
            streams.append(writer)
            await release.wait()
            got = bytearray()
            while len(got) < len(blob):
                data = await reader.read(65536)
                assert data
                got += data
            writer.write(bytes(got))
            await writer.drain()
            writer.close()
            await writer.wait_closed()

        acceptor = tls_stream.Acceptor(tls.server_context(cert, key), handler,
                                       handshake_timeout=5)
        server = tls_stream.TLSServer(await asyncio.get_running_loop().create_server(
            acceptor, "127.0.0.1", 0), acceptor)
        try:
            port = server.sockets[0].getsockname()[1]
            c = await HeyaClient.connect(port, Cert(tmp_path, "c"), greeting=None)
            c.send(blob)
            await asyncio.sleep(1.0)
            (stream,) = streams
            assert stream._paused_reading
            assert len(stream._buffer) <= tls_stream.READ_LIMIT + 2 * tls_stream.READ_CHUNK
            release.set()
            assert await c.read_exact(len(blob), timeout=60) == blob
            assert await asyncio.wait_for(c.reader.read(), 5) == b""
            c.close()
        finally:
            server.close()
            await server.wait_closed()
    asyncio.run(go())


# A TLS 1.3 client whose CertificateVerify is replaced in flight. Python's ssl refuses to load
# a certificate with another key, so the client runs with its real key over memory BIOs, logs
# its handshake secrets (keylog), and the bytes it sends are rewritten: the Certificate kept,
# CertificateVerify signed by `signer` over the real transcript (RFC 8446 §4.4.3), Finished
# recomputed for the new transcript (§4.4.4). The application keys do not depend on the
# client's second flight, so the client still reads what the server sends after it.

_SUITES = {0x1301: (AESGCM, 16, hashes.SHA256), 0x1302: (AESGCM, 32, hashes.SHA384),
           0x1303: (ChaCha20Poly1305, 32, hashes.SHA256)}


def _records(data: bytes) -> list[tuple[int, bytes, bytes]]:
    """(type, header, payload) of each TLS record."""
    out, i = [], 0
    while i < len(data):
        length = int.from_bytes(data[i + 3:i + 5], "big")
        out.append((data[i], data[i:i + 5], data[i + 5:i + 5 + length]))
        i += 5 + length
    return out


def _messages(data: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        length = int.from_bytes(data[i + 1:i + 4], "big")
        out.append(data[i:i + 4 + length])
        i += 4 + length
    return out


def _expand_label(secret: bytes, label: bytes, length: int, hash_cls) -> bytes:
    label = b"tls13 " + label
    info = length.to_bytes(2, "big") + bytes([len(label)]) + label + b"\x00"
    return HKDFExpand(hash_cls(), length, info).derive(secret)


class _RecordKeys:
    def __init__(self, secret: bytes, suite: int):
        aead, key_len, self.hash = _SUITES[suite]
        self.aead = aead(_expand_label(secret, b"key", key_len, self.hash))
        self.iv = _expand_label(secret, b"iv", 12, self.hash)
        self.seq = 0

    def _nonce(self) -> bytes:
        nonce = bytes(a ^ b for a, b in zip(self.iv, self.seq.to_bytes(12, "big")))
        self.seq += 1
        return nonce

    def open(self, header: bytes, payload: bytes) -> bytes:
        inner = self.aead.decrypt(self._nonce(), payload, header).rstrip(b"\x00")
        assert inner[-1] == 22, "a handshake record"
        return inner[:-1]

    def seal(self, handshake: bytes) -> bytes:
        inner = handshake + b"\x16"
        header = b"\x17\x03\x03" + (len(inner) + 16).to_bytes(2, "big")
        return header + self.aead.encrypt(self._nonce(), inner, header)


async def _resigned_handshake(port: int, cert: Cert, signer, keylog) -> bytes:
    ctx = client_context(cert)
    ctx.keylog_filename = str(keylog)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = ctx.wrap_bio(incoming, outgoing)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        with pytest.raises(ssl.SSLWantReadError):
            client.do_handshake()
        hello = outgoing.read()
        writer.write(hello)
        from_server = b""
        while True:   # until the client has the server's whole flight and answers it
            data = await asyncio.wait_for(reader.read(65536), 10)
            assert data, "server closed during its flight"
            from_server += data
            incoming.write(data)
            try:
                client.do_handshake()
                break
            except ssl.SSLWantReadError:
                pass
        flight = outgoing.read()

        secrets_ = dict(line.split()[0::2] for line in keylog.read_text().splitlines()
                        if line.startswith(("CLIENT_HANDSHAKE", "SERVER_HANDSHAKE")))
        (client_hello,) = [p for t, _, p in _records(hello) if t == 22]
        server_records = _records(from_server)
        (server_hello,) = [p for t, _, p in server_records if t == 22]
        suite = int.from_bytes(server_hello[39 + server_hello[38]:][:2], "big")
        server_keys = _RecordKeys(bytes.fromhex(secrets_["SERVER_HANDSHAKE_TRAFFIC_SECRET"]),
                                  suite)
        client_keys = _RecordKeys(bytes.fromhex(secrets_["CLIENT_HANDSHAKE_TRAFFIC_SECRET"]),
                                  suite)
        server_flight = b"".join(server_keys.open(h, p) for t, h, p in server_records
                                 if t == 23)
        client_records = _records(flight)
        ccs = b"".join(h + p for t, h, p in client_records if t == 20)
        certificate, verify, _finished = _messages(b"".join(
            client_keys.open(h, p) for t, h, p in client_records if t == 23))
        assert (certificate[0], verify[0]) == (11, 15)
        hash_cls = client_keys.hash

        def transcript(*msgs: bytes) -> bytes:
            h = hashes.Hash(hash_cls())
            h.update(client_hello + server_hello + server_flight + b"".join(msgs))
            return h.finalize()
        scheme = verify[4:6]
        assert scheme == b"\x04\x03"   # ecdsa_secp256r1_sha256
        signature = signer.sign(b"\x20" * 64 + b"TLS 1.3, client CertificateVerify\x00"
                                + transcript(certificate), ec.ECDSA(hashes.SHA256()))
        body = scheme + len(signature).to_bytes(2, "big") + signature
        new_verify = b"\x0f" + len(body).to_bytes(3, "big") + body
        secret = bytes.fromhex(secrets_["CLIENT_HANDSHAKE_TRAFFIC_SECRET"])
        mac = hmac.new(_expand_label(secret, b"finished", hash_cls.digest_size, hash_cls),
                       transcript(certificate, new_verify), hash_cls.name).digest()
        new_finished = b"\x14" + len(mac).to_bytes(3, "big") + mac
        client_keys.seq = 0   # in place of the client's records
        writer.write(ccs + client_keys.seal(certificate + new_verify + new_finished))

        got = b""
        while len(got) < len(b"HEYA 0\nDONE\n"):
            try:
                got += client.read(4096)
                continue
            except ssl.SSLWantReadError:
                pass
            data = await asyncio.wait_for(reader.read(65536), 10)
            if not data:
                raise ConnectionResetError("closed by the server")
            incoming.write(data)
        return got
    finally:
        writer.close()
