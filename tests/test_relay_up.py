"""`relay up` as a person runs it: child processes, where it listens, a message through it,
clean shutdown on SIGTERM, and `relay keys` agreeing with the key the relay serves."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

from relay.bench.startup import parent_pid

from relay_up_process import RelayUp
from trueseal_client import ACK, NK, XX, AsyncClient, deliver_ack_frame, keypair, push_frame


def test_relay_up_serves_and_stops_cleanly(tmp_path):
    # The stream's JVM options and Spark settings reach its session (stream.jvm_options,
    # [stream.spark_conf]): without Spark's Python daemon, its planning workers are plain
    # processes (the default keeps three pyspark.daemon processes for the query's life).
    conf = tmp_path / "relay.toml"
    conf.write_text('[stream]\njvm_options = "-Drelay.test.marker=up"\n'
                    '[stream.spark_conf]\n"spark.python.use.daemon" = "false"\n')
    relay = RelayUp(tmp_path / "data", RELAY_TRIGGER_INTERVAL_MS="100", RELAY_CONF=str(conf))
    keys_out = relay.cli("keys")
    relay_pub = bytes.fromhex(keys_out.split()[1])
    assert oct(os.stat(relay.data / "keys" / "trueseal_static.key").st_mode & 0o777) == "0o600"
    push, recv = relay.ports["TRUESEAL_PUSH"], relay.ports["TRUESEAL_RECEIVE"]
    try:
        relay.start()
        relay.ready(timeout=180)
        listening = {}
        for e in relay.events:
            if e["event"] == "role_ready":
                listening.update(e["listening"])
                assert e["listening"].get("metrics") == (
                    f"127.0.0.1:{relay.metrics_ports[e['role']]}"), (
                    e, [line for line in relay.stderr if "metrics" in line][-5:])
        for name, var in (("trueseal_push", "TRUESEAL_PUSH"),
                          ("trueseal_receive", "TRUESEAL_RECEIVE"), ("heya", "HEYA"),
                          ("ppp", "PPP"), ("sync", "SYNC")):
            assert listening[name] == f"127.0.0.1:{relay.ports[var]}", name
        asyncio.run(_one_message(push, recv, relay_pub))
        commands = relay.commands()
        assert any("java" in c and "-Drelay.test.marker=up" in c for c in commands), commands
        assert not any("pyspark.daemon" in c for c in commands), commands
        # `relay status` reads the tables and scrapes every running process
        st = json.loads(relay.cli("status", "--json"))
        roles = {r["role"]: r for r in st["roles"]}
        assert {r: roles[r]["state"] for r in relay.metrics_ports} == dict.fromkeys(
            relay.metrics_ports, "up")
        assert roles["ingress-trueseal"]["numbers"]["accepted"]["trueseal"] == 1
        assert set(roles) == set(relay.metrics_ports)
        # one ingress process per protocol, each a node with its own landing tables
        assert (relay.data / "tables" / "landing" / "node-0-trueseal").is_dir()
        code = relay.stop(signal.SIGTERM)
    finally:
        relay.kill()
    assert code == 0
    assert any(e["event"] == "shutting_down" for e in relay.events)
    assert [e["role"] for e in relay.events if e["event"] == "role_stopped"] == [
        "ingress-trueseal", "ingress-heya", "ingress-ppp", "ingress-sync", "stream", "egress",
        "push", "compact"]


def test_a_killed_stream_is_forked_again_and_serves(tmp_path):
    # The stream is forked from the zygote like every role (relay/up.py): killed, it is
    # forked again, its orphaned JVM goes, and Spark's Python processes never run on the
    # zygote's allocator.
    relay = RelayUp(tmp_path / "data", RELAY_TRIGGER_INTERVAL_MS="100")
    relay_pub = bytes.fromhex(relay.cli("keys").split()[1])
    push, recv = relay.ports["TRUESEAL_PUSH"], relay.ports["TRUESEAL_RECEIVE"]
    try:
        relay.start()
        relay.ready(timeout=180)
        first = relay.role_pid("stream")
        assert parent_pid(first) != relay.proc.pid          # the zygote's child, not relay up's
        runners = [env for _, args, env in relay._own_processes()
                   if "pyspark.sql.streaming.python_streaming_source_runner" in args]
        assert runners and not any("PYTHONMALLOC=malloc" in env for env in runners)
        os.kill(first, signal.SIGKILL)
        relay.wait_event("role_exited", 60, role="stream")
        relay.wait_event("role_ready", 180, nth=2, role="stream")
        assert relay.role_pid("stream") not in (None, first)
        asyncio.run(_one_message(push, recv, relay_pub))
        code = relay.stop(signal.SIGTERM)
    finally:
        relay.kill()
    assert code == 0
    deadline = time.monotonic() + 30
    while relay.leftovers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not relay.leftovers(), relay.commands()


async def _one_message(push, recv, relay_pub):
    priv, pub = keypair()
    c = await AsyncClient.connect(push, NK, relay_pub)
    c.send(push_frame(pub, b"hello through relay up"))
    assert await c.recv_frame(timeout=30) == ACK
    c.close()
    r = await AsyncClient.connect(recv, XX, relay_pub, static_priv=priv)
    while True:
        plain = await r.recv_frame(timeout=60)
        if plain[0] == 0x02:
            break
    assert plain[5 + 8:] == b"hello through relay up"
    r.send(deliver_ack_frame(int.from_bytes(plain[5:13], "big")))
    await asyncio.sleep(0.2)
    r.close()
