"""One `relay up` under attack: start it, measure the legitimate clients' baseline, run one
attack at a time from a separate process (tests/hostile/attacker.py), judge it against the
issue's rules and write the figures to the results file. One relay serves the whole run (its
start and baseline cost ~45 s; each attack is judged against the state just before it).

Rules (issue 19, "How it is proven"), per scenario:
* latency: every legitimate round trip started during the hold (the connections opened and
  held) completes, on every protocol, and the slowest is within `LATENCY_MARGIN` (1 s) of that
  protocol's baseline median measured before any attack. Round trips during the ramp are
  reported but not judged: the attacker then runs on the same two cores as the relay (its CPU
  seconds are in the figures), which a real attacker does not. For the same reason the
  attacker holds at nice `ATTACKER_HOLD_NICE` (a cursor-sync attacker keeps ~1,100 QUIC
  connections alive with ~45% of a core);
* memory: the listener's process (its own ingress-<protocol>; egress for trueseal receive) is
  back within 10% of its RSS before the attack within `RETURN_SECONDS` of letting go of the
  attacker's connections (the wait is in the figures);
* logs: the relay's stderr gains at most `LOG_LINES_PER_SECOND` lines per second of attack
  over its rate at rest;
* and the relay is still up (no role restarted).
Per listener, after all its scenarios: nothing the relay acked is lost.

Settings (environment): HOSTILE_CONNECTIONS (10000 per scenario), HOSTILE_RAMP_SECONDS (15:
the longest the attacker may take to open them; what it reached by then is reported),
HOSTILE_HOLD_SECONDS (5: how long they are held once open), HOSTILE_RESULTS
(hostile-results.json).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))   # tests/, when run as a script (the summary)

from legit_clients import PROTOCOLS, Prober  # noqa: E402
from relay_up_process import RelayUp  # noqa: E402
CONNECTIONS = int(os.environ.get("HOSTILE_CONNECTIONS", "10000"))
RAMP_SECONDS = float(os.environ.get("HOSTILE_RAMP_SECONDS", "15"))
HOLD_SECONDS = float(os.environ.get("HOSTILE_HOLD_SECONDS", "5"))
ATTACKER_HOLD_NICE = 10
RESULTS = Path(os.environ.get("HOSTILE_RESULTS", "hostile-results.json"))
LATENCY_MARGIN = 1.0          # issue 19: "within 1 s of its normal latency"
MEMORY_MARGIN = 0.10          # issue 19: "within 10% of its level before"
LOG_LINES_PER_SECOND = 5.0    # issue 19: "at most a few lines per second of attack"
SETTLE_SECONDS = 1.5          # after the relay let go of the attacker's sockets: read memory
# ... and while it is above the margin, read it again for up to this long: the heap trimmer
# (runtime/memory_trim.py) looks once a second and a full collection of a wave of 8,000
# WebSockets takes seconds; what is given back by then counts, and how long it took is kept.
RETURN_SECONDS = 10.0
BASELINE_ROUNDS = 5

ONE_ADDRESS = ["127.0.0.2"]                              # the legitimate clients use 127.0.0.1
LEGIT_ADDRESS = ["127.0.0.1"]                            # ... and so does a NAT neighbour
MANY_ADDRESSES = [f"127.0.0.{i}" for i in range(2, 255)]
LISTENER_PORT = {"trueseal_push": "TRUESEAL_PUSH", "trueseal_receive": "TRUESEAL_RECEIVE",
                 "heya": "HEYA", "ppp": "PPP", "sync": "SYNC", "sync_iroh": "SYNC_IROH"}
# the process each listener lives in: one ingress per protocol (ingress.process_per_protocol)
LISTENER_ROLE = {"trueseal_receive": "egress", "trueseal_push": "ingress-trueseal",
                 "heya": "ingress-heya", "ppp": "ingress-ppp", "sync": "ingress-sync",
                 "sync_iroh": "ingress-sync"}
# the `protocol` label of a listener's counters
LISTENER_PROTOCOL = {"trueseal_push": "trueseal", "trueseal_receive": "trueseal",
                     "sync_iroh": "sync"}
# the relay's listener a suite's listener is part of (its sessions gauge counts both of
# cursor-sync's transports; admission decisions are the aioquic side's)
LISTENER_NAME = {"sync_iroh": "sync"}
UDP = ("sync", "sync_iroh")      # held connections: the sessions gauge (one UDP socket)
LISTENER_ROLES = ("ingress-trueseal", "ingress-heya", "ingress-ppp", "ingress-sync", "egress")


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def descriptors(pid: int) -> int:
    """Open descriptors of a process (its sockets, plus a steady number of files)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _metrics(metrics_port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                    timeout=1.0) as resp:
            return resp.read().decode()
    except OSError:
        return None


def _counts(metrics_port: int, metric: str, where: str, keys: tuple[str, ...]
            ) -> dict[str, int]:
    """One counter's series whose labels include `where`, keyed by the values of `keys`
    (joined with "/")."""
    out: dict[str, int] = {}
    for line in (_metrics(metrics_port) or "").splitlines():
        if line.startswith(metric + "{") and where in line:
            labels, value = line.rsplit(" ", 1)
            key = "/".join(labels.split(f'{k}="', 1)[1].split('"', 1)[0] for k in keys)
            out[key] = int(float(value))
    return out


def refusals(metrics_port: int, protocol: str) -> dict[str, int]:
    """The listener's `relay_ingress_rejected_total` by reason (refusals, evictions,
    timeouts), so a scenario's figures say what the relay did to the attack."""
    return _counts(metrics_port, "relay_ingress_rejected_total", f'protocol="{protocol}"',
                   ("reason",))


def decisions(metrics_port: int, listener: str) -> dict[str, int]:
    """The listener's `relay_admission_decisions_total` as "stage/reason" -> count."""
    return _counts(metrics_port, "relay_admission_decisions_total",
                   f'listener="{listener}"', ("stage", "reason"))


def sessions_open(metrics_port: int, listener: str) -> int | None:
    """The listener's `relay_sessions_open` gauge from its process's /metrics."""
    text = _metrics(metrics_port)
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith("relay_sessions_open{") and f'listener="{listener}"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return None


def loop_lag(metrics_port: int) -> dict[str, float]:
    """The listener process's `relay_event_loop_lag_seconds` buckets (cumulative counts by
    upper bound), to tell how late its event loop ran in each phase of a scenario."""
    out: dict[str, float] = {}
    for line in (_metrics(metrics_port) or "").splitlines():
        if line.startswith("relay_event_loop_lag_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[le] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("relay_gc_pause_seconds_sum{"):     # all generations
            out["gc_s"] = out.get("gc_s", 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("relay_gc_pause_seconds_bucket{") and 'le="0.1"' in line:
            out["gc_le_0.1"] = out.get("gc_le_0.1", 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("relay_gc_pause_seconds_count{"):
            out["gc_n"] = out.get("gc_n", 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def lag_between(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """Loop-lag samples taken between two readings: how many, and how many later than
    50 ms, 100 ms and 250 ms."""
    def count(b: dict, le: str) -> float:
        return b.get(le, 0.0)
    n = count(after, "+Inf") - count(before, "+Inf")
    gc_n = count(after, "gc_n") - count(before, "gc_n")
    return {"n": int(n), **{f">{le}s": int(n - (count(after, le) - count(before, le)))
                            for le in ("0.05", "0.1", "0.25")},
            "gc_s": round(count(after, "gc_s") - count(before, "gc_s"), 3),
            "gc_over_0.1s": int(gc_n - (count(after, "gc_le_0.1") - count(before, "gc_le_0.1")))}


def cpu_seconds(pid: int | None) -> float:
    """user + system CPU of a process so far."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, TypeError, IndexError, ValueError):
        return 0.0


def _p50(xs):
    return round(statistics.median(xs), 3) if xs else None


class Results:
    """The results file, rewritten after every scenario (a partial run still has figures)."""

    def __init__(self, path: Path):
        self.path = path
        self.data = {"settings": {"connections": CONNECTIONS, "ramp_seconds": RAMP_SECONDS,
                                  "hold_seconds": HOLD_SECONDS,
                                  "latency_margin_s": LATENCY_MARGIN,
                                  "memory_margin": MEMORY_MARGIN,
                                  "log_lines_per_second": LOG_LINES_PER_SECOND,
                                  "cpus": os.cpu_count()},
                     "started": time.time(), "listeners": {}}
        self._lock = threading.Lock()

    def listener(self, name: str) -> dict:
        return self.data["listeners"].setdefault(name, {"scenarios": []})

    @property
    def relay(self) -> dict:
        return self.data.setdefault("relay", {})

    def save(self) -> None:
        with self._lock:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
            tmp.replace(self.path)


class RelayUnderAttack:
    def __init__(self, workdir: Path, results: Results):
        self.workdir = workdir
        self.results = results
        self.relay = RelayUp(workdir / "data", RELAY_TRIGGER_INTERVAL_MS="100")
        self.prober: Prober | None = None

    # --- life ----------------------------------------------------------------------------------
    def start(self) -> None:
        inbox_token = self.relay.cli("heya", "inbox-token").split()[0].encode()
        self.relay.start()
        self.relay.ready()
        keys = self.keys = dict(line.split() for line in self.relay.cli("keys").splitlines())
        info = SimpleNamespace(ports=self.relay.ports, keys=keys, inbox_token=inbox_token)
        self.prober = Prober(info, self.workdir / "legit")
        self.prober.start()
        self._baseline()

    def _baseline(self) -> None:
        t0 = time.time()
        lines0 = len(self.relay.stderr)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and any(
                self.prober.count(p, t0) < BASELINE_ROUNDS for p in PROTOCOLS):
            time.sleep(0.5)
        t1 = time.time()
        samples = self.prober.between(t0, t1)
        self.baseline = {}
        for p in PROTOCOLS:
            lat = [s.latency for s in samples if s.protocol == p and s.ok]
            bad = [s.error for s in samples if s.protocol == p and not s.ok]
            self.baseline[p] = {"n": len(lat), "p50_s": _p50(lat),
                                "max_s": round(max(lat), 3) if lat else None,
                                "failures": len(bad), "errors": bad[:3]}
        self.log_rate_at_rest = (len(self.relay.stderr) - lines0) / max(1.0, t1 - t0)
        rec = self.results.relay
        rec["baseline"] = self.baseline
        rec["log_lines_per_s_at_rest"] = round(self.log_rate_at_rest, 2)
        rec["rss_start_mib"] = {r: round(rss_kib(self.relay.role_pid(r)) / 1024, 1)
                                for r in LISTENER_ROLES}
        self.results.save()
        broken = [p for p in PROTOCOLS if self.baseline[p]["n"] < 2]
        if broken:
            raise RuntimeError(f"no baseline for {broken}: {self.baseline}")

    def stop(self) -> None:
        if self.prober is not None:
            self.prober.pause()
        self.relay.kill()
        self.results.relay["stderr_tail"] = [l.rstrip() for l in self.relay.stderr[-20:]]
        self.results.save()

    # --- one scenario ----------------------------------------------------------------------------
    def _recovered(self, timeout: float = 30.0) -> bool:
        """Wait until every protocol had a normal round trip after the last attack."""
        since = time.time()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.prober.count(p, since) >= 1 for p in PROTOCOLS):
                return True
            time.sleep(0.2)
        return False

    def attack(self, listener: str, stage: str, addresses: list[str], attempt: int = 1, *,
               count: int = CONNECTIONS, identity: str | None = None, served: float = 1.0,
               ping_seconds: float | None = None, parallel: int = 512
               ) -> tuple[dict, list[str]]:
        """Run one attack; its figures and the rules it broke (empty: passed). `attempt` 2 is
        the second run of a scenario whose first missed only its latency bound (scenarios.py).
        `count` connections, authenticating as `identity` (attacker.py: per_address, one,
        per_connection); `served`: the share of the attacked protocol's legitimate round
        trips that must succeed (the same-address scenarios: 0.9, the others: all);
        `ping_seconds`: the Heya attacker's PING interval; `parallel`: connections the
        attacker opens at once."""
        spread = "one_address" if len(addresses) == 1 else f"{len(addresses)}_addresses"
        if addresses == LEGIT_ADDRESS:
            spread = "legit_address"
        recovered = self._recovered()
        role = LISTENER_ROLE[listener]
        pid = self.relay.role_pid(role)
        if pid is None or self.relay.proc.poll() is not None:
            figures = {"listener": listener, "stage": stage, "addresses": spread,
                       "attempt": attempt, "broken": ["the relay is not running"],
                       "passed": False}
            self.results.listener(listener)["scenarios"].append(figures)
            self.results.save()
            return figures, figures["broken"]
        rss0, socks0 = rss_kib(pid), descriptors(pid)
        metrics_port = self.relay.metrics_ports[role]
        gauge = LISTENER_NAME.get(listener, listener)
        sessions0 = sessions_open(metrics_port, gauge) or 0
        protocol = LISTENER_PROTOCOL.get(listener, listener)
        refused0 = refusals(metrics_port, protocol)
        decisions0 = decisions(metrics_port, gauge)
        cpu0 = cpu_seconds(pid)
        lag0 = lag_ramped = loop_lag(metrics_port)
        lines0 = len(self.relay.stderr)
        spec = {"listener": listener, "stage": stage, "host": "127.0.0.1",
                "port": self.relay.ports[LISTENER_PORT[listener]], "count": count,
                "addresses": addresses, "parallel": parallel, "ramp_seconds": RAMP_SECONDS,
                "hold_seconds": HOLD_SECONDS, "drip_seconds": 3.0, "step_timeout": 10.0,
                "relay_pub": self.prober.clients[0].relay_pub.hex(),
                "relay_id": self.keys.get("sync-iroh-endpoint-id")}
        if identity is not None:
            spec["identity"] = identity
        if ping_seconds is not None:
            spec["ping_seconds"] = ping_seconds
        t_start = time.time()
        err_path = self.workdir / (f"attacker-{listener}-{stage}-{spread}-{identity}-{count}"
                                   ".stderr")
        with open(err_path, "w") as err:
            proc = subprocess.Popen([sys.executable, str(HERE / "attacker.py"),
                                     json.dumps(spec)], stdout=subprocess.PIPE, stderr=err,
                                    text=True)
        events: dict[str, dict] = {}
        reader = threading.Thread(target=self._read_events, args=(proc, events), daemon=True)
        reader.start()
        peak_rss, peak_socks, peak_sessions = rss0, socks0, sessions0
        cpu_ramped = None
        limit = time.monotonic() + RAMP_SECONDS + HOLD_SECONDS + 60
        while proc.poll() is None and time.monotonic() < limit:
            try:
                peak_rss = max(peak_rss, rss_kib(pid))
            except OSError:
                break
            peak_socks = max(peak_socks, descriptors(pid))
            peak_sessions = max(peak_sessions, sessions_open(metrics_port, gauge) or 0)
            if cpu_ramped is None and "ramped" in events:
                cpu_ramped = cpu_seconds(pid)
                # holding, the attacker yields the CPU it shares with the relay here (a real
                # one has its own): what it holds is the attack, not what it computes
                try:
                    os.setpriority(os.PRIO_PROCESS, proc.pid, ATTACKER_HOLD_NICE)
                except OSError:
                    pass
                lag_ramped = loop_lag(metrics_port)
            time.sleep(0.5)
        cpu_done = cpu_seconds(pid)
        lag_done = loop_lag(metrics_port)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        reader.join(5)
        t_done = events.get("done", {}).get("t", time.time())
        t_ramped = events.get("ramped", {}).get("t", t_start)
        # the relay lets go of what the attacker left (QUIC: its sessions, one UDP socket),
        # then memory is read
        settle_end = time.monotonic() + 20
        while time.monotonic() < settle_end and (
                descriptors(pid) > socks0 + 16 if listener not in UDP
                else (sessions_open(metrics_port, gauge) or 0) > sessions0 + 16):
            time.sleep(0.25)
        time.sleep(SETTLE_SECONDS)
        sessions_after = sessions_open(metrics_port, gauge)
        refused = {k: v - refused0.get(k, 0)
                   for k, v in refusals(metrics_port, protocol).items()
                   if v - refused0.get(k, 0)}
        alive = self.relay.proc.poll() is None and self.relay.role_pid(role) == pid
        rss1 = rss_kib(pid) if alive else 0
        returned_at = time.monotonic()
        while alive and rss1 > rss0 * (1 + MEMORY_MARGIN) and \
                time.monotonic() - returned_at < RETURN_SECONDS:
            time.sleep(0.5)
            rss1 = rss_kib(pid)
        memory_return_s = round(time.monotonic() - returned_at, 1)
        lines = len(self.relay.stderr) - lines0
        t_end = time.time()

        attacker = events.get("done") or events.get("ramped") or {}
        # what the relay held at most: its own gauge (QUIC shares one UDP socket), else the
        # descriptors it opened
        held = max(peak_sessions - sessions0, 0) if listener in UDP else max(
            0, peak_socks - socks0)
        ramped, done = events.get("ramped", {}), events.get("done", {})
        figures = {
            "listener": listener, "stage": stage, "addresses": spread, "attempt": attempt,
            "count": count, "identity": identity, "served_required": served,
            # the listener's admission decisions during the scenario (relay_admission_
            # decisions_total: stage/reason -> count)
            "admission": {k: v - decisions0.get(k, 0)
                          for k, v in decisions(metrics_port, gauge).items()
                          if v - decisions0.get(k, 0)},
            "recovered_before": recovered,
            "attacker": {k: attacker.get(k) for k in (
                "attempted", "established", "peak_open", "open_at_hold_end", "closed_in_ramp",
                "closed_in_hold", "connect_failed", "setup_failed")},
            "attacker_exit": proc.returncode,
            "attacker_stderr": err_path.read_text()[-800:],
            "ramp_s": round(t_ramped - t_start, 2), "hold_s": round(t_done - t_ramped, 2),
            "relay_sockets_peak": held,
            "relay_sessions_peak": peak_sessions,   # relay_sessions_open, at most
            "rss_before_mib": round(rss0 / 1024, 1), "rss_peak_mib": round(peak_rss / 1024, 1),
            "rss_after_mib": round(rss1 / 1024, 1),
            "rss_after_waited_s": memory_return_s,   # beyond SETTLE_SECONDS, at most RETURN_SECONDS
            # (peak - before) / held: meaningless for a handful, so only from 100 held
            "memory_per_connection_kib": round((peak_rss - rss0) / held, 1)
            if held >= 100 else None,
            "relay_sessions_after": sessions_after,
            "relay_refused": refused,     # relay_ingress_rejected_total during the scenario
            "log_lines": lines,
            "log_lines_per_s": round(lines / max(1.0, t_done - t_start), 2),
            "relay_alive": alive,
            # the listener's event loop: samples every 50 ms and how many ran late, per phase
            "loop_lag": {"ramp": lag_between(lag0, lag_ramped),
                         "hold": lag_between(lag_ramped, lag_done)},
            # CPU seconds: the listener's process and the attacker, while opening and holding
            "cpu_s": {"relay_ramp": round((cpu_ramped or cpu_done) - cpu0, 2),
                      "relay_hold": round(cpu_done - (cpu_ramped or cpu_done), 2),
                      "attacker_ramp": ramped.get("cpu_s"),
                      "attacker_hold": round(done["cpu_s"] - ramped["cpu_s"], 2)
                      if "cpu_s" in done and "cpu_s" in ramped else None},
        }
        legit = {}
        for p in PROTOCOLS:
            # judged: the rounds that started while the connections were held (the attacker
            # then idles; while it opens them it also eats this machine's CPU, so rounds
            # during the ramp are reported, not judged). None started: those overlapping.
            overlapping = [s for s in self.prober.between(t_ramped, t_done) if s.protocol == p]
            hold = [s for s in overlapping if s.start >= t_ramped] or overlapping
            ramp = [s for s in self.prober.between(t_start, t_ramped)
                    if s.protocol == p and s.start < t_ramped]
            ok = [s.latency for s in hold if s.ok]
            legit[p] = {"n": len(hold), "failures": sum(1 for s in hold if not s.ok),
                        "p50_s": _p50(ok), "max_s": round(max(ok), 3) if ok else None,
                        "errors": sorted({s.error for s in hold if not s.ok})[:3],
                        "ramp_n": len(ramp), "ramp_failures": sum(1 for s in ramp if not s.ok),
                        "ramp_max_s": round(max((s.latency for s in ramp if s.ok),
                                                default=0), 3)}
        figures["legit"] = legit
        figures["seconds"] = round(t_end - t_start, 1)
        # the listener's memory trims meanwhile (s after the attack started, objects its full
        # collection freed, seconds in all): a trim's collection stops the loop
        figures["relay_trims"] = _trims(self.relay.stderr[lines0:], role, t_start)
        # every round trip of the scenario: protocol, start (s after the attack started, the
        # hold starting at ramp_s), latency, error
        figures["legit_rounds"] = [
            [s.protocol, round(s.start - t_start, 2), round(s.latency, 3), s.error]
            for s in self.prober.between(t_start, t_done)]

        broken = []
        if not alive:
            broken.append("the relay (or the listener's role) did not survive")
        attacked = listener if listener in PROTOCOLS else LISTENER_PROTOCOL.get(listener,
                                                                                listener)
        for p, f in legit.items():
            allowed = self.baseline[p]["p50_s"] + LATENCY_MARGIN
            share = served if p == attacked else 1.0
            f["served"] = round(1 - f["failures"] / f["n"], 3) if f["n"] else None
            if f["n"] == 0:
                broken.append(f"{p}: no legitimate round trip during the hold")
            elif f["failures"] > (1 - share) * f["n"] + 1e-9:
                broken.append(f"{p}: {f['failures']} of {f['n']} legitimate round trips failed "
                              f"({'; '.join(f['errors'])})")
            elif f["max_s"] > allowed:
                broken.append(f"{p}: legitimate round trip {f['max_s']:.2f} s > baseline "
                              f"{self.baseline[p]['p50_s']:.2f} s + {LATENCY_MARGIN:.0f} s "
                              f"({_when_slowest(figures, p, t_ramped - t_start)})")
        if alive and rss1 > rss0 * (1 + MEMORY_MARGIN):
            broken.append(f"memory: {figures['rss_after_mib']} MiB after, "
                          f"{figures['rss_before_mib']} MiB before (> +{MEMORY_MARGIN:.0%})")
        excess = figures["log_lines_per_s"] - self.log_rate_at_rest
        if excess > LOG_LINES_PER_SECOND:
            broken.append(f"logs: {figures['log_lines_per_s']} lines/s during the attack, "
                          f"{self.log_rate_at_rest:.1f} at rest")
        if not attacker:
            broken.append(f"the attacker reported nothing (exit {proc.returncode}): "
                          f"{figures['attacker_stderr'][-300:]}")
        figures["broken"] = broken
        figures["passed"] = not broken
        self.results.listener(listener)["scenarios"].append(figures)
        self.results.save()
        return figures, broken

    @staticmethod
    def _read_events(proc, events: dict) -> None:
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and "event" in msg:
                events[msg["event"]] = msg

    def acked_lost(self, listener: str) -> dict:
        """Pause the legitimate clients, check everything they were acked, resume."""
        self.prober.pause()
        try:
            out = self.prober.verify()
        finally:
            self.prober.resume()
        self.results.listener(listener)["acked_after"] = out
        self.results.save()
        return out


def summary(data: dict) -> str:
    """The results as a table (for the README and the issue note)."""
    rows = ["| listener | stage | from | at the stage / tried | relay held | KiB per conn. "
            "| RSS before -> after MiB | legit p50/max s (" + ", ".join(PROTOCOLS) + ") "
            "| log lines/s | passed |", "|" + "---|" * 10]
    scenarios = passed = retried = 0
    for listener, rec in data.get("listeners", {}).items():
        for s in rec.get("scenarios", []):
            second = s.get("attempt", 1) == 2     # the first attempt's row is just above
            run_again = not second and only_slower(s.get("broken") or [])
            scenarios += not second
            retried += second
            passed += s.get("passed", False) and not run_again
            verdict = "yes" if s.get("passed") else "no"
            if second:
                verdict += " (attempt 2)"
            elif run_again:
                verdict += " (slower: run again)"
            if "attacker" not in s:
                rows.append(f"| {listener} | {s['stage']} | {s['addresses']} | | | | | | "
                            f"| {verdict} |")
                continue
            a, legit = s["attacker"], s["legit"]
            lat = ", ".join(f"{legit[p]['p50_s']}/{legit[p]['max_s']}"
                            + (f" ({legit[p]['failures']} failed)" if legit[p]["failures"]
                               else "") for p in PROTOCOLS)
            source = s['addresses'].replace('_', ' ')
            if s.get("identity") or s.get("count", CONNECTIONS) != CONNECTIONS:
                source += f" ({s.get('identity') or 'anonymous'}, {s.get('count')})"
            rows.append(
                f"| {listener} | {s['stage']} | {source} "
                f"| {a['established']} / {a['attempted']} | {s['relay_sockets_peak']} "
                f"| {s['memory_per_connection_kib']} | {s['rss_before_mib']} -> "
                f"{s['rss_after_mib']} | {lat} | {s['log_lines_per_s']} | {verdict} |")
    base = data.get("relay", {}).get("baseline", {})
    head = "baseline p50/max s: " + ", ".join(
        f"{p} {b.get('p50_s')}/{b.get('max_s')}" for p, b in base.items())
    tally = (f"{passed} of {scenarios} scenarios passed; {retried} run a second time after "
             f"missing only the latency bound")
    return head + "\n" + tally + "\n\n" + "\n".join(rows)


def _trims(lines: list[str], role: str, t0: float) -> list[list]:
    out = []
    for line in lines:
        if '"memory_trimmed"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("process") == role:
            out.append([round(rec["ts"] - t0, 2), rec.get("collected"), rec.get("seconds")])
    return out


def _when_slowest(figures: dict, protocol: str, hold_at: float) -> str:
    """Where a missed round trip fell: CI shows only the failure, and a miss at the ramp's
    end, mid-hold or at the attacker's leave has different causes."""
    rounds = [r for r in figures["legit_rounds"] if r[0] == protocol and r[1] >= hold_at]
    if not rounds:
        return "no round in the hold"
    _, start, latency, _ = max(rounds, key=lambda r: r[2])
    left = hold_at + figures["hold_s"]
    lag = figures["loop_lag"]["hold"]
    return (f"began {start - hold_at:.2f} s into the hold, the attacker left at "
            f"{left - hold_at:.2f} s; the listener's loop in the hold: {lag.get('>0.1s')} "
            f"stops > 0.1 s, {lag.get('>0.25s')} > 0.25 s, GC {lag.get('gc_s')} s; trims "
            f"[s into the hold, objects, s]: "
            f"{[[round(t - hold_at, 2), c, d] for t, c, d in figures['relay_trims']]}")


def only_slower(broken: list[str]) -> bool:
    """Every rule broken is the latency bound (`attack`'s wording): scenarios.py runs such
    a scenario once more."""
    return bool(broken) and all("legitimate round trip" in b and " > baseline " in b
                                for b in broken)


if __name__ == "__main__":
    print(summary(json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else RESULTS).read_text())))
