"""Two hosts, one live path (runtime/peer_link.py): ingress runs as a process on "host A"
(its own data directory, keys and node id), egress as a process on "host B" (its own), the
tables shared (a directory here). A trueseal receiver connected to B gets a push made to A
over the peer channel before any stream has run (so before its inbox row, which no
micro-batch has written yet), and once the stream gives it its row it is not delivered again
and the ack row carries the row's seq."""

from __future__ import annotations

import asyncio
import os
import time

from deltalake import DeltaTable

from crash_harness import RoleProc, free_ports
from delta_tables import peer_registry
from delta_tables.layout import Layout
from delta_tables.schema import C
from egress.pending import EARLY_BASE
from jobs.inbox_stream import start_inbox_stream
from relay import status
from runtime import config, keys
from test_end_to_end import parse_deliver
from trueseal_client import ACK, NK, XX, AsyncClient, deliver_ack_frame, keypair, push_frame

HEARTBEAT = 0x03


def host_env(tmp_path, name: str, tables, **more) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RELAY_", "AWS_"))}
    env.update(RELAY_DATA_DIR=str(tmp_path / name), RELAY_TABLES_DIR=str(tables),
               RELAY_LOG_FORMAT="json", PYTHONUNBUFFERED="1",
               RELAY_CLUSTER__PEER_REFRESH_SECONDS="0.5", RELAY_METRICS__INGRESS_PORT="0",
               RELAY_METRICS__EGRESS_PORT="0", **more)
    return env


async def wait_log(proc: RoleProc, event: str, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while f'"event": "{event}"' not in proc.stderr_path.read_text():
        assert time.monotonic() - t0 < timeout, f"{proc.role}: no {event} in {timeout:g} s"
        await asyncio.sleep(0.1)


async def ack_rows(layout: Layout, n: int, deadline: float) -> None:
    """Until the acks table holds `n` rows (the stream gave their envelopes their rows)."""
    while DeltaTable(str(layout.acks)).to_pyarrow_table().num_rows < n:
        assert time.monotonic() < deadline, f"fewer than {n} ack rows were written"
        await asyncio.sleep(0.2)


async def start_hosts(ingress: RoleProc, egress: RoleProc, tmp_path) -> tuple[bytes, bytes]:
    """Ingress on host A, then egress on host B until its channel to A is open; the trueseal
    keys of A and B (each host its own)."""
    ingress.start()
    await ingress.wait_ready(60)
    egress.start()
    await egress.wait_ready(60)
    await wait_log(egress, "peer_connected")
    return (keys.load_or_create(tmp_path / "a").public,
            keys.load_or_create(tmp_path / "b").public)


def test_a_push_to_host_a_reaches_a_receiver_on_host_b_before_its_row_and_once(
        tmp_path, spark):
    tables = tmp_path / "tables"
    push, peer, receive = free_ports(3)
    (tmp_path / "logs").mkdir()
    ingress = RoleProc("ingress-trueseal", host_env(
        tmp_path, "a", tables, RELAY_TRUESEAL_PUSH_PORT=str(push),
        RELAY_CLUSTER__PEER_LISTEN="true", RELAY_CLUSTER__PEER_PORT=str(peer)),
        [], tmp_path / "logs", command=["ingress", "--protocol", "trueseal"])
    egress = RoleProc("egress", host_env(
        tmp_path, "b", tables, RELAY_NODE_ID="node-b", RELAY_CLUSTER__PEER_DIAL="true",
        RELAY_TRUESEAL__RECEIVE_PORT=str(receive)), [], tmp_path / "logs")
    settings = config.load(None, env={}, data_dir=str(tmp_path / "stream"),
                           tables_dir=str(tables))

    async def main():
        a_pub, b_pub = await start_hosts(ingress, egress, tmp_path)
        names = {p.name: p for p in peer_registry.live(tables)}
        assert set(names) == {"node-0-trueseal", "node-b-egress"}
        assert a_pub != b_pub and names["node-0-trueseal"].key != names["node-b-egress"].key
        # `relay status` on a third host lists both registrations (and neither key nor endpoint)
        st = status.collect(settings)
        assert sorted((p.name, p.role, p.state) for p in st.peers) == [
            ("node-0-trueseal", "ingress", "alive"), ("node-b-egress", "egress", "alive")]
        text = status.format_status(st)
        assert "node-b-egress" in text and names["node-0-trueseal"].endpoint not in text
        priv, pub = keypair()
        rx = await AsyncClient.connect(receive, XX, b_pub, static_priv=priv)
        await asyncio.sleep(1.0)        # its mailbox's subscription crosses to host A
        tx = await AsyncClient.connect(push, NK, a_pub)
        envelope = b"sealed-" + os.urandom(500)
        t0 = time.monotonic()
        tx.send(push_frame(pub, envelope))
        assert await tx.recv_frame(timeout=10) == ACK
        blob_id, got = parse_deliver(await rx.recv_frame(timeout=5))
        took = time.monotonic() - t0
        tx.close()
        assert got == envelope and blob_id >= EARLY_BASE, took     # early: before any row
        layout = Layout.of(settings)
        assert DeltaTable(str(layout.inbox)).to_pyarrow_table().num_rows == 0
        rx.send(deliver_ack_frame(blob_id))

        query, _ = start_inbox_stream(spark, settings, fsync=False)
        try:
            await ack_rows(layout, 1, time.monotonic() + 120)
        finally:
            query.stop()
        (r,) = DeltaTable(str(layout.inbox)).to_pyarrow_table().to_pylist()
        (a,) = DeltaTable(str(layout.acks)).to_pyarrow_table().to_pylist()
        assert (a[C.SEQ], a[C.CURSOR], a[C.EVENT_ID]) == (r[C.SEQ], 1, r[C.EVENT_ID])
        try:    # nothing more for this session: at most a heartbeat
            frame = await rx.recv_frame(timeout=1.0)
            assert frame is None or frame[0] == HEARTBEAT, "delivered twice"
        except asyncio.TimeoutError:
            pass
        rx.close()
        assert await egress.term(30) == 0 and await ingress.term(30) == 0
        for proc in (ingress, egress):
            text = proc.stderr_path.read_text()
            assert a_pub.hex() not in text and envelope.hex() not in text
            assert str(peer) not in text.replace(f'"port": {peer}', "")
    try:
        asyncio.run(main())
    finally:
        egress.cleanup()
        ingress.cleanup()
