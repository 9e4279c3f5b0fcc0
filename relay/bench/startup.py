"""`relay bench --startup`: how soon a fresh `relay up` acks a message, and what the whole relay
costs while nobody uses it (issue 20 item 3: ack within 3 s of start, idle <= 0.05 cores and
<= 800 MiB).

Each round starts `relay up` on a new data directory (every listener on an ephemeral port),
as an operator would, and then once more on the same directory (`restart_*`: the usual
start, every table there); each measures from the moment it is spawned:

* `first_ppp_ack_s`: a PPP client that retries every 20 ms from the moment the PPP listener
  is announced gets its first STORED (a landing commit: acked means durable);
* `ingress_ready_s`: every ingress role announced ready; `relay_ready_s`: `relay up` said
  ready (the stream has run its boot batch);
* then (the cold start only), from `IDLE_AFTER_S` after ready, for `IDLE_FOR_S`: CPU of the whole process tree in
  cores, and its memory as PSS (shared pages counted once) and summed RSS, in MiB. 70 s:
  Spark keeps the Python workers of the query's planning for a minute of idleness (its
  PythonWorkerFactory's idle timeout); the figure is the relay's steady idle, without them.

Figures are medians over the rounds (`--rounds`, default 3). `relay up` is stopped with
SIGINT to its process group, as Ctrl-C in a terminal does. Results go to
`bench-startup.json` (or `--out`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from runtime import config

from .harness import CpuMeter, machine, rounded, say, write_conf

IDLE_AFTER_S = 70.0
IDLE_FOR_S = 20.0


def parent_pid(pid: int) -> int:
    """The parent of `pid`, from /proc (after the last ")": a command name may hold one)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _tree(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = parent_pid(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += kids.get(pid, [])
    return out


RELAY_COMMANDS = ("up", "ingress", "stream", "egress", "compact", "push", "spark")


def process_label(argv: list[str]) -> str:
    """What a process of the relay's tree is, from its command line: `ingress ppp`, `stream`,
    `spark jvm`, `spark python daemon` (the module Spark started), ..."""
    if not argv:
        return "?"
    if len(argv) == 1:     # a title set by the process (the zygote's children: relay/zygote.py)
        argv = argv[0].split()
    if argv[:2] == ["relay", "zygote"]:
        return "zygote"
    if os.path.basename(argv[0]).startswith("java"):
        return "spark jvm"
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1].startswith("pyspark"):
        return "spark python " + argv[argv.index("-m") + 1].rsplit(".", 1)[-1]
    if any("pyspark" in a for a in argv):
        return "spark python"
    cmd = next((a for a in argv[1:] if a in RELAY_COMMANDS), None)
    if cmd is None:
        return os.path.basename(argv[0])
    if cmd == "ingress" and "--protocol" in argv:
        return f"ingress {argv[argv.index('--protocol') + 1]}"
    return cmd


def memory_mib(root: int) -> dict:
    """PSS and RSS of a process tree, MiB (Linux smaps_rollup), and PSS by process (what to
    cut first: issue 20's idle target is for the whole tree)."""
    pss = rss = 0
    by: dict[str, int] = {}
    pids = _tree(root)
    for pid in pids:
        try:
            mine = 0
            for line in open(f"/proc/{pid}/smaps_rollup"):
                if line.startswith("Pss:"):
                    mine = int(line.split()[1])
                    pss += mine
                elif line.startswith("Rss:"):
                    rss += int(line.split()[1])
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        label = process_label([a for a in argv.split("\0") if a])
        by[label] = by.get(label, 0) + mine
    return {"pss_mib": round(pss / 1024), "rss_mib": round(rss / 1024),
            "processes": len(pids),
            "pss_mib_by_process": {k: round(v / 1024) for k, v in
                                   sorted(by.items(), key=lambda kv: -kv[1])}}


async def _first_ack(port: int, deadline: float) -> float:
    """Seconds (monotonic) at which a STORE was first acked, retrying every 20 ms."""
    import msgpack
    from nacl.signing import SigningKey
    from websockets.asyncio.client import connect
    from engine.ppp.keys import Identity
    from relay.ppp_client import build_presence
    me, peer = Identity.generate(), Identity.generate()
    sk = SigningKey(me.seed)
    while time.monotonic() < deadline:
        try:
            async with connect(f"ws://127.0.0.1:{port}/v1/ws", open_timeout=5) as ws:
                ch = msgpack.unpackb(await ws.recv(), raw=False)
                await ws.send(msgpack.packb({"cmd": "AUTH", "pubkey": me.pubkey,
                                             "sig": sk.sign(ch["nonce"]).signature}))
                msgpack.unpackb(await ws.recv(), raw=False)
                await ws.send(msgpack.packb({"cmd": "STORE", "event": build_presence(
                    me, peer.pubkey, "first").encode()}))
                if msgpack.unpackb(await ws.recv(), raw=False).get("cmd") == "STORED":
                    return time.monotonic()
        except Exception:   # not serving yet: refused, reset, closed mid-handshake
            pass
        await asyncio.sleep(0.02)
    raise RuntimeError("no PPP ack before the deadline")


def one_round(args, root: Path) -> dict:
    """A cold start on a new data directory (then idle), and a restart on the same one (the
    operator's usual start: every table exists, the control planes load)."""
    # As an operator's: only the listeners move to ephemeral ports (metrics stay served).
    settings = config.load(getattr(args, "conf", None), data_dir=str(root / "data"))
    for section, key in (("trueseal", "push_port"), ("trueseal", "receive_port"),
                         ("heya", "port"), ("ppp", "port"), ("sync", "port"),
                         ("sync", "iroh_port")):
        setattr(getattr(settings, section), key, 0)
    conf = write_conf(settings, root / "relay.toml")
    cold = _up(settings, conf, root, idle=True)
    warm = _up(settings, conf, root, idle=False)
    return {**cold, **{f"restart_{k}": v for k, v in warm.items()}}


def _up(settings, conf: Path, root: Path, *, idle: bool) -> dict:
    env = dict(os.environ, RELAY_LOG_FORMAT="json")
    log = open(root / "up.log", "a")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "relay.cli", "--conf", str(conf),
                             "--data-dir", str(root / "data"), "up"], stdout=subprocess.PIPE,
                            stderr=log, text=True, env=env, start_new_session=True)
    seen: dict = {"ingress": set(), "ppp_port": None}
    events = {"ppp": threading.Event(), "ingress": threading.Event(),
              "ready": threading.Event()}
    roles_ingress = [r for r in _roles(settings) if r.startswith("ingress")]

    def read() -> None:
        for line in proc.stdout:
            try:
                m = json.loads(line)
            except ValueError:
                continue
            if m.get("event") == "role_ready":
                role = m.get("role", "")
                if role.startswith("ingress"):
                    seen["ingress"].add(role)
                    if "ppp" in m.get("listening", {}):
                        seen["ppp_port"] = int(m["listening"]["ppp"].rsplit(":", 1)[1])
                        events["ppp"].set()
                    if seen["ingress"] >= set(roles_ingress):
                        seen["ingress_at"] = time.monotonic()
                        events["ingress"].set()
            elif m.get("event") == "relay_ready":
                seen["ready_at"] = time.monotonic()
                events["ready"].set()
    threading.Thread(target=read, daemon=True).start()
    out: dict = {}
    try:
        if not events["ppp"].wait(120):
            raise RuntimeError(f"the PPP listener never started (see {root / 'up.log'})")
        acked = asyncio.run(_first_ack(seen["ppp_port"], time.monotonic() + 120))
        if not events["ready"].wait(180):
            raise RuntimeError(f"relay up never said ready (see {root / 'up.log'})")
        events["ingress"].wait(5)
        out = {"first_ppp_ack_s": rounded(acked - t0, 2),
               "ingress_ready_s": rounded(seen.get("ingress_at", float("nan")) - t0, 2),
               "relay_ready_s": rounded(seen["ready_at"] - t0, 2)}
        if idle:
            time.sleep(IDLE_AFTER_S)
            meter = CpuMeter(relay=proc.pid)
            meter.start()
            time.sleep(IDLE_FOR_S)
            cpu = meter.stop()
            out.update(idle_cores=cpu["relay"], idle_machine_busy_cores=cpu["machine_busy"],
                       **memory_mib(proc.pid))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    out["exit_code"] = proc.returncode
    return out


def _roles(settings) -> list[str]:
    return list(config.process_roles(settings))


def main(args) -> int:
    rounds = args.rounds or 3
    out = Path(args.out or "bench-startup.json")
    res: dict = {"mode": "startup", "machine": machine(os.getloadavg()),
                 "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "idle_after_s": IDLE_AFTER_S, "idle_for_s": IDLE_FOR_S, "rounds": []}
    for n in range(rounds):
        root = Path(tempfile.mkdtemp(prefix="relay-startup-"))
        try:
            say(f"startup round {n + 1}/{rounds}")
            r = one_round(args, root)
            say("  " + ", ".join(f"{k} {v}" for k, v in r.items()))
            res["rounds"].append(r)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    first = res["rounds"][0]
    keys = [k for k, v in first.items()
            if not k.endswith("exit_code") and not isinstance(v, dict)]
    res["median"] = {k: statistics.median(r[k] for r in res["rounds"]) for k in keys}
    labels = {p for r in res["rounds"] for p in r.get("pss_mib_by_process", {})}
    res["median_pss_mib_by_process"] = dict(sorted(
        ((p, statistics.median(r.get("pss_mib_by_process", {}).get(p, 0)
                               for r in res["rounds"])) for p in labels),
        key=lambda kv: -kv[1]))
    res["targets"] = {"first_ack_s": {"target": 3.0, "measured": res["median"]["first_ppp_ack_s"]},
                      "idle_cores": {"target": 0.05, "measured": res["median"]["idle_cores"]},
                      "idle_pss_mib": {"target": 800, "measured": res["median"]["pss_mib"]}}
    out.write_text(json.dumps(res, indent=2) + "\n")
    say(f"wrote {out}: " + ", ".join(f"{k} {v}" for k, v in res["median"].items()))
    say("idle PSS MiB by process: " + ", ".join(
        f"{k} {v}" for k, v in res["median_pss_mib_by_process"].items()))
    return 0
