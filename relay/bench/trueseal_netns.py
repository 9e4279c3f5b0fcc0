"""`relay bench --trueseal-netns`: trueseal's one-connection-per-push shape with the load
generator on its own network host, and what the NK handshake's rewrite saves.

On this machine's two cores the load generator and the relay share the CPU, so the acked
rate of one NK connection per push is bounded by both. This bench puts the client
processes in a network namespace of their own (`ip netns`, created and removed here; root
only) joined to this one by a veth pair on a private /24, so their connections reach the
relay as from another host (a real NIC path, not loopback), and measures the relay's own
CPU per connection (the bench process, where the `IngressNode` runs): one core's worth of
the relay alone acks `1e6 / relay_cpu_us_per_push` a second (`relay_cpu_bound_per_core`).

Every round runs four runs in an alternating order: {loopback, netns} x {the written-out
NK responder (engine/noise_nk.py, what the relay runs), noiseprotocol's generic responder
(what it ran before)}; each figure is the median over the rounds. The namespace and its
veth are removed on exit, also after an error. Before the rounds, `nk_handshake_cpu`: the
relay side of one NK connection's cryptography alone, both responders, without any I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from .harness import machine, rounded, say, serving, settings_for
from .netns import client_host

ROUNDS = 3
SIZES = {"ingress_seconds": 5, "ingress_warmup_s": 1}


@contextlib.contextmanager
def responder(kind: str):
    """The push listener's NK responder for one run: "written_out" (the relay's own) or
    "package" (noiseprotocol's, swapped in for the comparison only)."""
    from engine.noise_session import NoiseResponder
    from engine.trueseal import session
    own = session.NKResponder
    if kind == "package":
        session.NKResponder = lambda static: NoiseResponder("NK", static)
    try:
        yield
    finally:
        session.NKResponder = own


async def _one(settings, host: str, netns: str | None, kind: str, clients: int) -> dict:
    from ingress.service import IngressNode

    from .trueseal import _ingress_shape
    settings.bind = host
    with responder(kind):
        async with serving(IngressNode(settings)) as node:
            out = await _ingress_shape(node, "per_connection", SIZES, clients, host, netns)
    return {k: out[k] for k in ("acked_per_s", "relay_cpu_us_per_push",
                                "relay_cpu_bound_per_core_derived", "relay_cpu_cores",
                                "listener_thread_busy", "client_cpu_cores", "errors",
                                "push_to_ack_ms_p50", "push_to_ack_ms_p99", "failures")}


def handshake_cpu_us(n: int = 1000, runs: int = 7) -> dict:
    """The relay side of one NK connection's cryptography alone, in this process's CPU
    microseconds: a responder made, message 1 read, message 2 written, one transport
    message (the Ack) encrypted, closed; message 1s made ahead by the bench's own initiator
    (trueseal_client.NKInitiator). Both responders in alternating order, medians of `runs`
    runs of `n`."""
    import os as _os

    from engine.noise_nk import NKResponder
    from engine.noise_session import NoiseResponder, StaticKey

    from .trueseal_client import NKInitiator
    static = StaticKey(_os.urandom(32))
    msgs = [NKInitiator(static.public).message1() for _ in range(n)]
    makers = {"written_out": NKResponder,
              "package": lambda key: NoiseResponder("NK", key)}
    times: dict[str, list[float]] = {k: [] for k in makers}
    for i in range(runs):
        for name in (list(makers) if i % 2 == 0 else list(makers)[::-1]):
            make = makers[name]
            t0 = time.process_time()
            for m in msgs:
                r = make(static)
                r.receive_handshake(m)
                r.encrypt(b"\x00" * 40)
                r.close()
            times[name].append((time.process_time() - t0) / n * 1e6)
    med = {k: rounded(statistics.median(v), 1) for k, v in times.items()}
    return {"us_per_connection": med, "runs": {k: [rounded(x, 1) for x in v]
                                                for k, v in times.items()},
            "written_out_over_package": rounded(med["written_out"] / med["package"], 2)}


RUNS = [("loopback", "written_out"), ("netns", "written_out"), ("loopback", "package"),
        ("netns", "package")]


def main(args) -> int:
    out_path = Path(getattr(args, "out", None) or "bench-trueseal-netns.json")
    rounds = max(1, int(getattr(args, "rounds", None) or ROUNDS))
    clients = max(1, (os.cpu_count() or 2) - 1)
    root = Path(tempfile.mkdtemp(prefix="relay-bench-netns-"))
    res: dict = {"started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "machine": machine(os.getloadavg()), "client_processes": clients,
                 "seconds": SIZES["ingress_seconds"], "warmup_s": SIZES["ingress_warmup_s"],
                 "rounds": []}
    say("NK handshake CPU, both responders ...")
    res["nk_handshake_cpu"] = handshake_cpu_us()
    say(f"  {res['nk_handshake_cpu']['us_per_connection']} us per connection")
    with client_host() as (ns, relay_addr):
        for n in range(rounds):
            one: dict = {}
            order = RUNS if n % 2 == 0 else RUNS[::-1]
            for where, kind in order:
                say(f"round {n + 1} of {rounds}: clients on {where}, {kind} NK responder")
                s = settings_for(args, root / f"r{n}-{where}-{kind}")
                host = relay_addr if where == "netns" else "127.0.0.1"
                one[f"{where}.{kind}"] = asyncio.run(
                    _one(s, host, ns if where == "netns" else None, kind, clients))
            res["rounds"].append(one)
    res["median"] = {name: {k: rounded(statistics.median(r[name][k] or 0
                                                         for r in res["rounds"]), 1)
                            for k in res["rounds"][0][name] if k != "failures"}
                     for name in res["rounds"][0]}
    m = res["median"]
    res["written_out_over_package"] = {
        where: {"acked_per_s": rounded(m[f"{where}.written_out"]["acked_per_s"]
                                       / max(1, m[f"{where}.package"]["acked_per_s"]), 2),
                "relay_cpu_us_per_push": rounded(
                    m[f"{where}.written_out"]["relay_cpu_us_per_push"]
                    / max(1, m[f"{where}.package"]["relay_cpu_us_per_push"]), 2)}
        for where in ("loopback", "netns")}
    out_path.write_text(json.dumps(res, indent=2) + "\n")
    for name, v in m.items():
        say(f"{name:<24} {v['acked_per_s']:>8} acked/s  relay {v['relay_cpu_us_per_push']} "
            f"us/push (one core: {v['relay_cpu_bound_per_core_derived']}/s)  clients "
            f"{v['client_cpu_cores']} cores")
    say(f"wrote {out_path}")
    return 0
