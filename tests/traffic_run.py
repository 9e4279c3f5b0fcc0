"""One traffic run for tests/test_metrics.py and tests/test_logs.py (the `traffic` fixture,
session-scoped through conftest.py, so the run happens once).

Ingress, the stream and egress run in this process on loopback, each with its own registry
served over HTTP as `relay ingress|stream|egress` serve it; the numbers are read back by
scraping, the way Prometheus (and `relay status`) read them, at points of the run where the
test knows exactly what was sent. Every JSON log line of `relay.*` loggers, debug included,
is kept.
"""

from __future__ import annotations

import asyncio
import logging
import os

import pytest

from egress.service import EgressNode
from ingress.service import IngressNode
from jobs.inbox_stream import start_inbox_stream
from runtime import metrics
from runtime.logs import JsonFormatter

from trueseal_client import ACK, ERROR, NK, XX, AsyncClient, deliver_ack_frame, frame, keypair, \
    push_frame

GOOD_1, GOOD_2, OVERSIZE, SHORT, RETRIES = 30, 20, 4, 3, 5
MAX_ENVELOPE = 1000


def scrape(server) -> dict:
    return metrics.scrape(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5)


async def ascrape(server) -> dict:
    return await asyncio.to_thread(scrape, server)


def value(samples, name, **labels) -> float:
    return metrics.total(samples, name, **labels)


class Traffic:
    """What the run sent, for the assertions and the log scan."""

    def __init__(self):
        self.envelopes: list[bytes] = []
        self.mailboxes: list[bytes] = []
        self.secrets: list[bytes] = []     # private keys of the test's devices
        self.relay_keys: list[bytes] = []
        self.log_lines: list[str] = []
        self.checks: dict[str, object] = {}


@pytest.fixture(scope="session")
def traffic(spark, tmp_path_factory):
    """One traffic run through real sockets, Delta and Spark."""
    from runtime import config
    settings = config.load(None, env={}, data_dir=str(tmp_path_factory.mktemp("m") / "data"))
    settings.trueseal.push_port = settings.trueseal.receive_port = 0
    settings.heya.port = 0
    settings.sync.port = 0
    settings.sync.iroh_port = 0
    settings.ppp.port = 0
    settings.trueseal.max_envelope = MAX_ENVELOPE
    out = Traffic()
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(self.format(record))

    handler = Keep(level=logging.DEBUG)
    handler.setFormatter(JsonFormatter("test"))
    relay_log = logging.getLogger("relay")
    old_level = relay_log.level
    relay_log.addHandler(handler)
    relay_log.setLevel(logging.DEBUG)
    try:
        asyncio.run(_run(settings, spark, out))
    finally:
        relay_log.removeHandler(handler)
        relay_log.setLevel(old_level)
    out.log_lines = lines
    return out


async def _run(settings, spark, out: Traffic) -> None:
    ingress = IngressNode(settings, fsync=False)
    await ingress.start()
    ing = metrics.serve_ephemeral(metrics.ingress_registry(ingress))
    relay_pub = ingress.key.public
    out.relay_keys += [relay_pub, ingress.key.private_bytes]
    (a_priv, a_pub), (b_priv, b_pub) = keypair(), keypair()
    out.mailboxes += [a_pub, b_pub]
    out.secrets += [a_priv, b_priv]
    push_port = ingress.trueseal.bound_port
    c = out.checks
    try:
        before = await ascrape(ing)
        c["accepted_0"] = value(before, "relay_ingress_accepted_total", protocol="trueseal")

        # phase 1: GOOD_1 pushes, pipelined on one session, A and B alternating
        first = [((a_pub, b_pub)[i % 2], b"m1-%03d-" % i + os.urandom(120))
                 for i in range(GOOD_1)]
        out.envelopes += [e for _, e in first]
        s = await AsyncClient.connect(push_port, NK, relay_pub)
        for r, e in first:
            s.send(push_frame(r, e))
        assert [await s.recv_frame(timeout=30) for _ in first] == [ACK] * GOOD_1
        mid = await ascrape(ing)
        c["sessions_during"] = value(mid, "relay_sessions_open", listener="trueseal_push")
        c["held_during"] = metrics.by_label(mid, "relay_connections_held", "stage")
        s.close()
        c["accepted_1"] = value(mid, "relay_ingress_accepted_total", protocol="trueseal")
        c["commit_rows_1"] = value(mid, "relay_commit_rows_total", table="landing")
        c["commits_1"] = value(mid, "relay_commits_total", table="landing")
        c["commit_hist_count_1"] = value(mid, "relay_commit_latency_seconds_count",
                                         table="landing")

        # phase 2: good, oversize and short pushes mixed on one session
        second = [(a_pub, b"m2-%03d-" % i + os.urandom(100)) for i in range(GOOD_2)]
        out.envelopes += [e for _, e in second]
        s = await AsyncClient.connect(push_port, NK, relay_pub)
        expect = []
        for i, (r, e) in enumerate(second):
            s.send(push_frame(r, e))
            expect.append(ACK)
            if i < OVERSIZE:
                big = b"big-%d-" % i + os.urandom(MAX_ENVELOPE + 10)
                out.envelopes.append(big)
                s.send(push_frame(b_pub, big))
                expect.append(ERROR)
            if i < SHORT:
                s.send(frame(0x01, b"short-%d" % i))
                expect.append(ERROR)
        assert [await s.recv_frame(timeout=30) for _ in expect] == expect
        s.close()
        # retries of already-acked envelopes: ingress accepts them, the stream drops them
        s = await AsyncClient.connect(push_port, NK, relay_pub)
        for r, e in first[:RETRIES]:
            s.send(push_frame(r, e))
        assert [await s.recv_frame(timeout=30) for _ in range(RETRIES)] == [ACK] * RETRIES
        s.close()
        await asyncio.sleep(0.2)   # the server side sees the close
        after = await ascrape(ing)
        c["accepted_2"] = value(after, "relay_ingress_accepted_total", protocol="trueseal")
        c["rejected_2"] = metrics.by_label(after, "relay_ingress_rejected_total", "reason")
        c["commit_rows_2"] = value(after, "relay_commit_rows_total", table="landing")
        c["sessions_after"] = value(after, "relay_sessions_open", listener="trueseal_push")
        c["held_after"] = metrics.by_label(after, "relay_connections_held", "stage")

        # the stream, with its own registry, over what landed
        from delta_tables.landing_lag import landing_lag
        from delta_tables.layout import Layout
        layout = Layout.of(settings)
        stream_metrics = metrics.StreamMetrics(settings.data_dir, lambda: landing_lag(layout))
        st = metrics.serve_ephemeral(stream_metrics.registry)
        try:
            pre = await ascrape(st)
            c["lag_before"] = value(pre, "relay_landing_lag_versions")
            c["lag_seconds_before"] = value(pre, "relay_landing_lag_seconds")

            def run_stream():
                query, _ = start_inbox_stream(spark, settings, available_now=True, fsync=False,
                                              on_batch=stream_metrics.observe_batch)
                query.awaitTermination(180)
                assert query.exception() is None
                stream_metrics.observe_progress(query.lastProgress)

            await asyncio.to_thread(run_stream)
            post = await ascrape(st)
            c["stream_rows"] = value(post, "relay_stream_rows_total")
            c["stream_accepted"] = value(post, "relay_stream_accepted_total", protocol="trueseal")
            c["stream_rejected"] = metrics.by_label(post, "relay_stream_rejected_total", "reason")
            c["stream_batches"] = value(post, "relay_stream_batches_total")
            c["stream_hist_count"] = value(post, "relay_stream_batch_duration_seconds_count")
            c["lag_after"] = value(post, "relay_landing_lag_versions")
            c["lag_seconds_after"] = value(post, "relay_landing_lag_seconds")
        finally:
            metrics.stop(st)

        # egress: A's device receives and acks its envelopes
        egress = EgressNode(settings, fsync=False)
        await egress.start()
        eg = metrics.serve_ephemeral(metrics.egress_registry(egress))
        try:
            e0 = await ascrape(eg)
            c["pending_0"] = value(e0, "relay_egress_pending", protocol="trueseal")
            want_a = sum(1 for r, _ in first if r == a_pub) + GOOD_2
            rc = await AsyncClient.connect(egress.trueseal.bound_port, XX, relay_pub,
                                           static_priv=a_priv)
            got = 0
            while got < want_a:
                plain = await rc.recv_frame(timeout=30)
                if plain[0] == 0x02:
                    rc.send(deliver_ack_frame(int.from_bytes(plain[5:13], "big")))
                    got += 1
            for _ in range(200):   # acks are durable a group commit later
                e1 = await ascrape(eg)
                if value(e1, "relay_egress_acked_total", protocol="trueseal") == want_a:
                    break
                await asyncio.sleep(0.05)
            c["want_a"] = want_a
            c["delivered"] = value(e1, "relay_egress_delivered_total", protocol="trueseal")
            c["acked"] = value(e1, "relay_egress_acked_total", protocol="trueseal")
            c["pending_1"] = value(e1, "relay_egress_pending", protocol="trueseal")
            c["receive_sessions"] = value(e1, "relay_sessions_open", listener="trueseal_receive")
            c["receive_held"] = metrics.by_label(e1, "relay_connections_held", "stage")
            c["ack_commit_rows"] = value(e1, "relay_commit_rows_total", table="acks")
            c["role"] = value(e1, "relay_process_info", role="egress")
            rc.close()
        finally:
            metrics.stop(eg)
            await egress.close()
    finally:
        metrics.stop(ing)
        await ingress.close()
