"""runtime/inbox_signal.py: the stream wakes the inbox followers after each commit, so a
delivery does not wait for a poll (issue 13). Real sockets on loopback, a real stream."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

from egress.service import EgressNode
from ingress.service import IngressNode
from jobs.inbox_stream import start_inbox_stream
from runtime.inbox_signal import (BlockingSignal, InboxSignal, InboxSignalSender,
                                  landing_signal_dir, signal_dir)

from test_end_to_end import receive
from trueseal_client import ACK, NK, AsyncClient, keypair, push_frame


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_registered_follower_is_woken_and_a_dead_one_is_forgotten(tmp_path):
    directory = tmp_path / "run" / "inbox-signal"

    async def go():
        sig = await InboxSignal.open(directory, "egress")
        assert sig.path.name == f"{os.getpid()}-egress" and sig.path.read_text().isdigit()
        stale = directory / f"{_dead_pid()}-heya"
        stale.write_text("9")                       # a follower killed without closing
        sender = InboxSignalSender(directory)
        assert await sig.wait(0.05) is False        # nothing committed yet
        sender.notify(7)
        assert await sig.wait(5.0) is True
        assert not stale.exists()                   # removed, not sent to
        for n in range(3):                          # commits during one poll: one wake-up
            sender.notify(8 + n)
        await asyncio.sleep(0.2)
        assert await sig.wait(1.0) is True
        assert await sig.wait(0.05) is False
        assert sig.received == 4 and sender.sent == 4
        sig.close()
        assert not sig.path.exists()
        sender.notify(11)                           # no follower left: nothing, no error
        assert sender.sent == 4 and sender.failed == 0
        sender.close()

    asyncio.run(go())


def test_listeners_are_told_of_an_inbox_commit_without_polling(spark, settings):
    """Polling every 60 s: a push still reaches an online receiver in seconds, woken by the
    stream's signal. Every process that follows the inbox registered for it."""
    settings.egress.poll_interval_ms = 60_000
    settings.stream.trigger_interval_ms = 100
    query, _sink = start_inbox_stream(spark, settings, fsync=False)
    try:
        asyncio.run(_scenario(settings))
    finally:
        query.stop()


async def _scenario(settings):
    settings.trueseal.early_delivery = False     # the inbox row's path, not ingress's hand-off
    ingress, egress = IngressNode(settings, fsync=False), EgressNode(settings, fsync=False)
    await ingress.start()
    await egress.start()
    try:
        relay_pub = ingress.key.public
        priv, pub = keypair()
        online = asyncio.create_task(receive(egress.trueseal.bound_port, relay_pub, priv, 1,
                                             timeout=30))
        await asyncio.sleep(1.0)         # the tails' first polls are done: only a wake-up now
        registered = {p.name.partition("-")[2] for p in signal_dir(settings.data_dir).iterdir()}
        assert registered == {"egress", "heya", "ppp", "sync"}
        started = time.monotonic()
        c = await AsyncClient.connect(ingress.trueseal.bound_port, NK, relay_pub)
        c.send(push_frame(pub, b"woken, not polled"))
        assert await c.recv_frame(timeout=30) == ACK
        c.close()
        conn, got = await online
        took = time.monotonic() - started
        assert [e for _, e in got] == [b"woken, not polled"]
        assert took < 30 and egress.tail.woken >= 1, (took, egress.tail.woken)
        conn.close()
    finally:
        await ingress.close()
        await egress.close()
    assert not any(signal_dir(settings.data_dir).iterdir())   # each closed its registration


def test_a_blocking_signal_wakes_on_a_datagram_and_drains_the_rest(tmp_path):
    directory = tmp_path / "run" / "landing-signal"
    sig = BlockingSignal(directory, "landing-source")
    try:
        sender = InboxSignalSender(directory)
        assert sig.wait(0.05) is False
        for _ in range(3):
            sender.notify(0)
        assert sig.wait(5.0) is True
        assert sig.wait(0.05) is False          # three commits, one wake-up
        assert sig.received == 3
    finally:
        sig.close()
    assert not any(directory.iterdir())


def test_an_idle_stream_waits_for_a_landing_commit_and_is_woken_by_it(spark, settings):
    """The source waits up to 60 s for data here: a push still reaches an online receiver in
    seconds only because the ingress node's landing commit wakes it (stream.wait_for_data_ms)."""
    settings.stream.wait_for_data_ms = 60_000
    settings.stream.trigger_interval_ms = 100
    query, sink = start_inbox_stream(spark, settings, fsync=False)
    try:
        deadline = time.monotonic() + 120
        while not sink.history:                  # the boot batch ran: the source now waits
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.0)
        names = [p.name for p in landing_signal_dir(settings.data_dir).iterdir()]
        assert [n.partition("-")[2] for n in names] == ["landing-source"]
        asyncio.run(_scenario(settings))
    finally:
        _stop_waiting(query, settings)


def _stop_waiting(query, settings) -> None:
    """Stop a query whose source may be waiting: poke it until the stop went through."""
    done = threading.Event()

    def poke():
        sender = InboxSignalSender(landing_signal_dir(settings.data_dir))
        while not done.wait(0.2):
            sender.notify(0)
        sender.close()
    t = threading.Thread(target=poke, daemon=True)
    t.start()
    query.stop()
    done.set()
    t.join()
