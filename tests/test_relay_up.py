"""`relay up` as a person runs it: child processes, where it listens, a message through it,
clean shutdown on SIGTERM, and `relay keys` agreeing with the key the relay serves."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from trueseal_client import ACK, NK, XX, AsyncClient, deliver_ack_frame, keypair, push_frame


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_relay_up_serves_and_stops_cleanly(tmp_path):
    data = tmp_path / "data"
    push, recv, heya, ppp, sync = (free_port() for _ in range(5))
    env = dict(os.environ, RELAY_DATA_DIR=str(data), RELAY_TRUESEAL_PUSH_PORT=str(push),
               RELAY_TRUESEAL_RECEIVE_PORT=str(recv), RELAY_TRIGGER_INTERVAL_MS="100",
               RELAY_HEYA_PORT=str(heya), RELAY_SYNC_PORT=str(sync),
               RELAY_PPP_PORT=str(ppp))
    metrics_ports = {role: free_port() for role in ("ingress", "egress", "stream", "compact")}
    env.update({f"RELAY_METRICS_PORT_{role.upper()}": str(port)
                for role, port in metrics_ports.items()})
    keys_out = subprocess.run([sys.executable, "-m", "relay.cli", "keys"], env=env,
                              capture_output=True, text=True, check=True).stdout
    relay_pub = bytes.fromhex(keys_out.split()[1])
    assert oct(os.stat(data / "keys" / "trueseal_static.key").st_mode & 0o777) == "0o600"

    proc = subprocess.Popen([sys.executable, "-m", "relay.cli", "up"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while sum("ready" in l for l in seen) < 4:
            assert time.monotonic() < deadline, seen
            assert proc.poll() is None, seen
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        text = "".join(seen)
        assert f"trueseal_push on 127.0.0.1:{push}" in text
        assert f"trueseal_receive on 127.0.0.1:{recv}" in text
        assert f"heya on 127.0.0.1:{heya}" in text
        assert f"ppp on 127.0.0.1:{ppp}" in text
        assert f"sync on 127.0.0.1:{sync}" in text
        for role, port in metrics_ports.items():
            assert f"metrics on 127.0.0.1:{port}" in text, role
        asyncio.run(_one_message(push, recv, relay_pub))
        # `relay status` reads the tables and scrapes the four running processes
        st = json.loads(subprocess.run([sys.executable, "-m", "relay.cli", "status", "--json"],
                                       env=env, capture_output=True, text=True,
                                       check=True).stdout)
        roles = {r["role"]: r for r in st["roles"]}
        assert {r: roles[r]["state"] for r in metrics_ports} == dict.fromkeys(metrics_ports, "up")
        assert roles["ingress"]["numbers"]["accepted"]["trueseal"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    rest = seen + [lines.get_nowait() for _ in range(lines.qsize())]
    assert code == 0
    assert any("shutting down" in l for l in rest)
    assert [r for r in ("ingress", "stream", "egress", "compact")
            if any(f"relay: {r} stopped" in l for l in rest)] == ["ingress", "stream", "egress",
                                                                   "compact"]


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
