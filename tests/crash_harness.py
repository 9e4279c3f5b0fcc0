"""Helpers of the kill -9 crash test (tests/test_crash.py).

* `RoleProc`: one relay role (`python -m relay.cli <role>`) as a real subprocess in its own
  session, so the role and everything it started (the stream's JVM and Python workers) can be
  SIGKILLed at once, as a crashed machine or an OOM kill would take them.
* `PushLoad`: concurrent trueseal push clients (Noise NK built from the spec bytes by
  tests/trueseal_client.py) with an outbox: a Push counts as acked only when its Ack frame
  arrived; a session that ends without the reply is retried later over a new session, so
  crashes create duplicates in landing that the stream must drop.
* `Receivers`: one device per mailbox (Noise XX); every Deliver is recorded, then DeliverAcked;
  the device reconnects whenever its session ends.

Nothing here imports relay code: the relay is only reached through sockets and its tables
(read with delta-rs; with `RELAY_TEST_TABLES=s3` on the S3 server, through
`delta_tables.object_store`'s paths).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from noise.exceptions import NoiseInvalidMessage

from delta_tables import object_store
from egress.pending import EARLY_BASE

from trueseal_client import (HEARTBEAT, NK, XX, Client, deliver_ack_frame, keypair, push_frame,
                             split_u16)

REPO = Path(__file__).resolve().parent.parent

TAG_DELIVER, TAG_HEARTBEAT, TAG_ACK, TAG_ERROR = 0x02, 0x03, 0x04, 0x05


def free_ports(n: int) -> list[int]:
    """n distinct ports that are free now (bound together, so no duplicates)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_TABLES: dict[Path, object] = {}


def tables_dir(data: Path):
    """Where the tables of the relay with data directory `data` are: `<data>/tables`, or its
    prefix on the S3 server."""
    return _TABLES.get(Path(data), Path(data) / "tables")


def landing_generations(data: Path) -> list:
    """Every landing table (each node's generations), oldest first."""
    root = tables_dir(data) / "landing"
    if not root.exists():
        return []
    return [gen for node in sorted(root.iterdir()) if node.is_dir()
            for gen in sorted(node.iterdir())
            if gen.name[:1] == "g" and gen.name[1:].isdigit() and latest_commit(gen) >= 0]


def latest_commit(table: Path) -> int:
    """Newest version in a Delta table's log (-1 if none), from the file names only."""
    try:
        names = object_store.listdir(table / "_delta_log")
    except FileNotFoundError:
        return -1
    return max((int(n[:20]) for n in names if n.endswith(".json") and n[:20].isdigit()),
               default=-1)


def log(msg: str) -> None:
    print(f"[crash {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- processes ---------------------------------------------------------------------------------

def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        out.setdefault(ppid, []).append(int(d))
    return out


def descendants(pid: int) -> list[int]:
    kids, todo, out = _children_map(), [pid], []
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class RoleProc:
    """One relay role; `start` may be called again after the process ended (a restart)."""

    def __init__(self, role: str, env: dict[str, str], argv_prefix: list[str], logdir: Path,
                 command: list[str] | None = None):
        """`role`: what its ready line names; `command`: the subcommand (default `[role]`)."""
        self.role = role
        self.env = env
        self.argv = [sys.executable, "-m", "relay.cli", *argv_prefix, *(command or [role])]
        self.logdir = logdir
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0
        self.stderr_path = logdir / f"{role}.stderr.log"
        self.stdout_path: Path | None = None
        self.ready_msg: dict | None = None
        self.tree: set[int] = set()     # every pid seen in this role's tree (for cleanup)
        self.kills = 0
        self.terms = 0
        self.exit_codes: list[int] = []
        self.last_stop_seconds: float | None = None
        self.orphans: set[int] = set()  # left running by a driver-only kill
        self.stragglers: list[int] = []  # still alive well after their role ended

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.role} still running"
        self.incarnation += 1
        self.stdout_path = self.logdir / f"{self.role}.{self.incarnation}.stdout.log"
        self.ready_msg = None
        with open(self.stderr_path, "a") as err:
            err.write(f"===== crash harness: start {self.role} #{self.incarnation} "
                      f"at {time.time():.3f} =====\n")
            err.flush()
            with open(self.stdout_path, "w") as out:
                self.proc = subprocess.Popen(self.argv, cwd=REPO, env=self.env,
                                             stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                             start_new_session=True)
        self.tree.add(self.proc.pid)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _check_ready(self) -> dict | None:
        try:
            text = self.stdout_path.read_text()
        except FileNotFoundError:
            return None
        for line in text.splitlines():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("ready") == self.role:
                return msg
        return None

    async def wait_ready(self, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            self._snapshot_tree()
            msg = self._check_ready()
            if msg is not None:
                self.ready_msg = msg
                return time.monotonic() - t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited with {self.proc.returncode} before ready"
                                   f"\n{self.tail()}")
            await asyncio.sleep(0.1)
        raise TimeoutError(f"{self.role} not ready after {timeout}s\n{self.tail()}")

    def _snapshot_tree(self) -> None:
        if self.running:
            self.tree.update(descendants(self.proc.pid))

    def kill9(self, whole_tree: bool = True) -> None:
        """SIGKILL the role and everything it started, at once (a crashed machine or
        container); or, with `whole_tree=False`, the role's own process only (kill -9 <pid>):
        what it started (the stream's JVM) is then left to notice and exit by itself, and
        may still be dying while the role restarts. `reap_orphans` collects it."""
        assert self.running, f"{self.role} is not running"
        self._snapshot_tree()
        if whole_tree:
            pids = [self.proc.pid] + descendants(self.proc.pid)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        else:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.exit_codes.append(self.proc.returncode)
        self.kills += 1
        if whole_tree:
            self._reap_tree(10)
        else:
            self.orphans |= self.tree - {self.proc.pid}
            self.tree.clear()

    async def reap_orphans(self, timeout: float = 30.0) -> float | None:
        """Seconds until the orphans of a driver-only kill were all gone by themselves; None
        if they had to be SIGKILLed after `timeout`."""
        t0 = time.monotonic()
        while any(_alive(p) for p in self.orphans):
            if time.monotonic() - t0 > timeout:
                self.stragglers += [p for p in self.orphans if _alive(p)]
                self._kill_all(self.orphans)
                self.orphans.clear()
                return None
            await asyncio.sleep(0.1)
        self.orphans.clear()
        return time.monotonic() - t0

    @staticmethod
    def _kill_all(pids) -> None:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _reap_tree(self, timeout: float, grace: float = 0.0) -> list[int]:
        """Wait until no process of this role's tree is left: `grace` seconds for them to
        exit by themselves (who does not is recorded in `stragglers`), then SIGKILL."""
        t0 = time.monotonic()
        while True:
            left = [p for p in self.tree if _alive(p)]
            if not left:
                self.tree.clear()
                return []
            waited = time.monotonic() - t0
            if waited > timeout:
                return left
            if waited >= grace:
                if grace:
                    self.stragglers += left
                    grace = 0.0
                self._kill_all(left)
            time.sleep(0.05)

    async def term(self, timeout: float) -> int | None:
        """SIGTERM, wait up to `timeout`; the exit code, or None if it had to be killed."""
        assert self.running
        self._snapshot_tree()
        self.proc.send_signal(signal.SIGTERM)
        self.terms += 1
        t0 = time.monotonic()
        while self.proc.poll() is None and time.monotonic() - t0 < timeout:
            await asyncio.sleep(0.1)
        self.last_stop_seconds = round(time.monotonic() - t0, 2)
        if self.proc.poll() is None:
            self.kill9()
            return None
        self.exit_codes.append(self.proc.returncode)
        self._reap_tree(30, grace=15)
        return self.proc.returncode

    def cleanup(self) -> None:
        """Finalizer: never leave this role (or its JVM) running."""
        if self.running:
            self._snapshot_tree()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        if self.running:
            self.kill9()
        self.tree |= self.orphans
        left = self._reap_tree(10)
        if left:
            log(f"{self.role}: could not reap pids {left}")

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return f"({self.role}: no stderr)"
        return f"--- {self.role} stderr (last {lines} lines) ---\n" + "\n".join(text[-lines:])


# -- wire helpers ------------------------------------------------------------------------------

# Every port a role may listen on gets a free one, so that concurrent runs (and a relay on the
# default ports) never collide.
PORT_VARS = ("RELAY_TRUESEAL_PUSH_PORT", "RELAY_TRUESEAL_RECEIVE_PORT", "RELAY_PPP_PORT",
             "RELAY_SYNC_PORT", "RELAY_SYNC_IROH_PORT", "RELAY_HEYA_PORT", "RELAY_METRICS_PORT_INGRESS",
             "RELAY_METRICS_PORT_EGRESS", "RELAY_METRICS_PORT_STREAM",
             "RELAY_METRICS_PORT_COMPACT", "RELAY_METRICS_PORT_PUSH")


class RelayProcesses:
    """A data directory, a conf file, free ports and one `RoleProc` per role: the relay a
    crash test starts, kills and restarts."""

    def __init__(self, tmp_path: Path, conf: str, roles: tuple[str, ...],
                 s3_endpoint: str | None = None):
        """`s3_endpoint`: the tables go to that S3 server (conftest's `s3_endpoint`)."""
        self.data = tmp_path / "data"
        self.logs = tmp_path / "logs"
        self.logs.mkdir()
        self.ports = dict(zip(PORT_VARS, free_ports(len(PORT_VARS))))
        conf_file = tmp_path / "relay.toml"
        conf_file.write_text(conf)
        self.prefix = ["--conf", str(conf_file)]
        self.env = dict(os.environ, RELAY_DATA_DIR=str(self.data),
                        RELAY_TRIGGER_INTERVAL_MS="100", PYTHONUNBUFFERED="1",
                        **{var: str(p) for var, p in self.ports.items()})
        if s3_endpoint:
            from relay.bench.s3_server import BUCKET
            uri, loc = f"s3://{BUCKET}/{tmp_path.name}", object_store.S3Location(s3_endpoint)
            self.env.update(RELAY_TABLES_DIR=uri, RELAY_S3_ENDPOINT=s3_endpoint)
            object_store.configure_env(loc)       # for this process's delta-rs reads
            _TABLES[self.data] = object_store.table_root(uri, loc)
        self.procs = {r: RoleProc(r, self.env, self.prefix, self.logs) for r in roles}

    def tails(self) -> str:
        return "\n".join(p.tail() for p in self.procs.values())

    def cleanup(self) -> None:
        for p in self.procs.values():
            p.cleanup()


class SessionLost(Exception):
    """The relay went away (refused, reset, EOF, timeout) before the exchange finished."""


class ProtocolViolation(Exception):
    """The relay sent something the spec does not allow (bad Noise message, wrong frame)."""


class Wire:
    """One Noise session over asyncio streams; frames in, frames out."""

    def __init__(self, reader, writer, client: Client):
        self.reader, self.writer, self.client = reader, writer, client
        self.frames: deque[bytes] = deque()

    @classmethod
    async def open(cls, port: int, pattern: bytes, relay_pub: bytes,
                   static_priv: bytes | None = None, timeout: float = 5.0) -> "Wire":
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port), timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise SessionLost(f"connect: {type(exc).__name__}") from None
        self = cls(reader, writer, Client(pattern, relay_pub, static_priv))
        try:
            writer.write(self.client.hello())
            data = b""
            while not split_u16(data)[0]:
                chunk = await asyncio.wait_for(reader.read(65536), timeout)
                if not chunk:
                    raise SessionLost("EOF in handshake")
                data += chunk
            try:
                out = self.client.answer(data)
            except (NoiseInvalidMessage, AssertionError) as exc:
                raise ProtocolViolation(f"handshake: {exc!r}") from None
            if out:
                writer.write(out)
            await writer.drain()
        except (OSError, asyncio.TimeoutError) as exc:
            self.close()
            raise SessionLost(f"handshake: {type(exc).__name__}") from None
        except BaseException:
            self.close()
            raise
        return self

    def send(self, plaintext: bytes) -> None:
        self.writer.write(self.client.send(plaintext))

    async def drain(self) -> None:
        try:
            await self.writer.drain()
        except OSError as exc:
            raise SessionLost(f"write: {type(exc).__name__}") from None

    async def recv(self, timeout: float | None) -> bytes | None:
        """Next frame's plaintext, None at EOF; SessionLost on reset, TimeoutError on timeout."""
        while not self.frames:
            try:
                data = await asyncio.wait_for(self.reader.read(65536), timeout)
            except TimeoutError:        # an OSError subclass, and asyncio's since 3.11
                raise
            except OSError as exc:
                raise SessionLost(f"read: {type(exc).__name__}") from None
            if not data:
                return None
            try:
                self.frames.extend(self.client.receive(data))
            except NoiseInvalidMessage as exc:
                raise ProtocolViolation(f"decrypt: {exc!r}") from None
        return self.frames.popleft()

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass


def parse_frame(plain: bytes) -> tuple[int, bytes]:
    if len(plain) < 5:
        raise ProtocolViolation(f"short frame {plain!r}")
    n = int.from_bytes(plain[1:5], "big")
    if len(plain) != 5 + n:
        raise ProtocolViolation(f"frame length {n} but message {len(plain)} bytes")
    return plain[0], plain[5:]


# -- push load ---------------------------------------------------------------------------------

ENV_MAGIC = b"CRSH"


def make_envelope(uid: int, rng: random.Random) -> bytes:
    size = rng.choice([64, 200, 256, 700, 1024, 1500, 4096])
    return ENV_MAGIC + uid.to_bytes(8, "big") + rng.randbytes(max(0, size - 12))


def envelope_uid(env: bytes) -> int | None:
    if len(env) < 12 or env[:4] != ENV_MAGIC:
        return None
    return int.from_bytes(env[4:12], "big")


@dataclass
class PushStats:
    sessions: int = 0
    connect_failures: int = 0
    lost_sessions: int = 0          # sessions that ended before every reply arrived
    pushes_sent: int = 0            # Push frames written (retries included)
    retries: int = 0                # pushes sent again after a session without their reply
    errors: int = 0                 # Error replies (retried too)
    reply_timeouts: int = 0         # no reply within the bound: the relay held a Push silently
    violations: list[str] = field(default_factory=list)
    unexpected_frames: Counter = field(default_factory=Counter)


class PushLoad:
    """`total` envelopes to `mailboxes`, produced at a steady pace over `duration` seconds and
    pushed by `workers` clients. Each client keeps an outbox of unacked envelopes and replays
    it over new sessions until each is acked."""

    def __init__(self, port: int, relay_pub: bytes, mailboxes: list[bytes], total: int,
                 duration: float, workers: int, seed: int, reply_timeout: float = 30.0,
                 first_uid: int = 1):
        """`first_uid`: where this load's envelope uids start (two loads, distinct uids)."""
        self.first_uid = first_uid
        self.port, self.relay_pub, self.mailboxes = port, relay_pub, mailboxes
        self.total, self.duration, self.workers = total, duration, workers
        self.rng = random.Random(seed)
        self.seed = seed
        self.reply_timeout = reply_timeout
        self.sent: dict[int, tuple[int, bytes]] = {}      # uid -> (mailbox index, envelope)
        self.acked: dict[int, float] = {}                 # uid -> monotonic time of the Ack
        self.first_sent: dict[int, float] = {}
        self.stats = PushStats()
        self.queue: asyncio.Queue[int] = asyncio.Queue()
        self.produced = 0
        self.in_flight = 0                                 # Pushes written, reply not yet read
        self.producer_done = asyncio.Event()
        self.stop = asyncio.Event()        # set when the test gives up waiting
        self.tasks: list[asyncio.Task] = []
        self.outboxes: list[deque[int]] = []

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.tasks.append(asyncio.create_task(self._produce(), name="push-producer"))
        for w in range(self.workers):
            self.outboxes.append(deque())
            self.tasks.append(asyncio.create_task(self._worker(w), name=f"push-{w}"))

    async def _produce(self) -> None:
        for n, uid in enumerate(range(self.first_uid, self.first_uid + self.total)):
            due = self.t0 + self.duration * n / self.total
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            mbox = self.rng.randrange(len(self.mailboxes))
            self.sent[uid] = (mbox, make_envelope(uid, self.rng))
            self.produced = n + 1
            self.queue.put_nowait(uid)
        self.producer_done.set()

    @property
    def unacked(self) -> int:
        return self.total - len(self.acked)

    async def _worker(self, w: int) -> None:
        rng = random.Random(self.seed * 1000 + w)
        outbox = self.outboxes[w]
        while not self.stop.is_set():
            if not outbox:
                if self.producer_done.is_set() and self.queue.empty():
                    return
                try:
                    outbox.append(await asyncio.wait_for(self.queue.get(), 0.5))
                except asyncio.TimeoutError:
                    continue
            # Mostly the real client's one Push per session; sometimes pipelined sessions.
            k = rng.choice([1, 1, 1, 1, 2, 3, 5, 8, 16])
            while len(outbox) < k and not self.queue.empty():
                outbox.append(self.queue.get_nowait())
            batch = [outbox.popleft() for _ in range(min(k, len(outbox)))]
            outcomes = await self._session(batch)
            failed = False
            for uid, outcome in zip(batch, outcomes):
                if outcome == "ack":
                    self.acked.setdefault(uid, time.monotonic())
                else:
                    outbox.append(uid)
                    self.stats.retries += 1
                    failed = True
            if failed:
                await asyncio.sleep(rng.uniform(0.05, 0.4))

    async def _session(self, batch: list[int]) -> list[str]:
        st = self.stats
        try:
            wire = await Wire.open(self.port, NK, self.relay_pub)
        except SessionLost:
            st.connect_failures += 1
            return ["lost"] * len(batch)
        except ProtocolViolation as exc:
            st.violations.append(f"push handshake: {exc}")
            return ["lost"] * len(batch)
        st.sessions += 1
        outcomes: list[str] = []
        counted = 0
        try:
            for uid in batch:
                mbox, env = self.sent[uid]
                self.first_sent.setdefault(uid, time.monotonic())
                wire.send(push_frame(self.mailboxes[mbox], env))
                st.pushes_sent += 1
            self.in_flight += len(batch)
            counted = len(batch)
            await wire.drain()
            while len(outcomes) < len(batch):
                try:
                    plain = await wire.recv(self.reply_timeout)
                except asyncio.TimeoutError:
                    st.reply_timeouts += 1
                    break
                if plain is None:
                    break
                tag, _body = parse_frame(plain)
                if tag == TAG_ACK:
                    outcomes.append("ack")
                elif tag == TAG_ERROR:
                    st.errors += 1
                    outcomes.append("error")
                else:
                    st.unexpected_frames[tag] += 1
        except SessionLost:
            pass
        except ProtocolViolation as exc:
            st.violations.append(f"push: {exc}")
        finally:
            wire.close()
            self.in_flight -= counted
        if len(outcomes) < len(batch):
            st.lost_sessions += 1
        return outcomes + ["lost"] * (len(batch) - len(outcomes))

    async def close(self) -> None:
        self.stop.set()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


# -- receivers ---------------------------------------------------------------------------------

@dataclass
class Delivery:
    mailbox: int
    session: int          # per-mailbox session number
    blob_id: int
    envelope: bytes
    at: float


@dataclass
class ReceiveStats:
    sessions: int = 0
    connect_failures: int = 0
    heartbeats: int = 0
    violations: list[str] = field(default_factory=list)
    in_session_duplicates: list[tuple[int, int, int]] = field(default_factory=list)
    out_of_order: list[tuple[int, int, int, int]] = field(default_factory=list)
    early: int = 0        # Delivers before the inbox row (provisional blob ids)
    unexpected_frames: Counter = field(default_factory=Counter)


class Receivers:
    """One XX device per mailbox key, recording Delivers, acking each after recording it."""

    def __init__(self, port: int, relay_pub: bytes, n: int):
        self.port, self.relay_pub = port, relay_pub
        self.keys = [keypair() for _ in range(n)]          # (priv, pub)
        self.deliveries: list[Delivery] = []
        self.delivered_uids: dict[int, int] = {}             # uid -> times delivered
        self.stats = ReceiveStats()
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task] = []
        self.delivered = asyncio.Event()     # set on every Deliver (after its DeliverAck)
        self.delivered_early = asyncio.Event()   # ... that came before its inbox row

    @property
    def mailboxes(self) -> list[bytes]:
        return [pub for _priv, pub in self.keys]

    def start(self) -> None:
        for i in range(len(self.keys)):
            self.tasks.append(asyncio.create_task(self._device(i), name=f"recv-{i}"))

    async def _device(self, i: int) -> None:
        priv, _pub = self.keys[i]
        session = 0
        st = self.stats
        while not self.stop.is_set():
            try:
                wire = await Wire.open(self.port, XX, self.relay_pub, static_priv=priv)
            except SessionLost:
                st.connect_failures += 1
                await asyncio.sleep(0.2)
                continue
            except ProtocolViolation as exc:
                st.violations.append(f"receive handshake: {exc}")
                await asyncio.sleep(0.2)
                continue
            session += 1
            st.sessions += 1
            seen: set[int] = set()
            seen_uids: set[int] = set()
            last = {False: 0, True: 0}      # per kind: inbox seqs, early (provisional) ids
            try:
                while not self.stop.is_set():
                    try:
                        plain = await wire.recv(0.5)
                    except asyncio.TimeoutError:
                        continue
                    if plain is None:
                        break
                    tag, body = parse_frame(plain)
                    if tag == TAG_HEARTBEAT:
                        st.heartbeats += 1
                        wire.send(HEARTBEAT)
                        continue
                    if tag != TAG_DELIVER:
                        st.unexpected_frames[tag] += 1
                        continue
                    if len(body) < 8:
                        st.violations.append(f"Deliver body of {len(body)} bytes")
                        continue
                    blob_id, env = int.from_bytes(body[:8], "big"), body[8:]
                    uid = envelope_uid(env)
                    early = blob_id >= EARLY_BASE
                    if blob_id in seen or (uid is not None and uid in seen_uids):
                        st.in_session_duplicates.append((i, session, blob_id))
                    elif blob_id <= last[early]:
                        # inbox seqs rise, and so do early ids; an early envelope may come
                        # before rows that were still in the micro-batch (egress/pending.py)
                        st.out_of_order.append((i, session, last[early], blob_id))
                    seen.add(blob_id)
                    if uid is not None:
                        seen_uids.add(uid)
                    last[early] = max(last[early], blob_id)
                    st.early += early
                    self.deliveries.append(Delivery(i, session, blob_id, env, time.monotonic()))
                    if uid is not None:
                        self.delivered_uids[uid] = self.delivered_uids.get(uid, 0) + 1
                    # The real client DeliverAcks at once (interop §7); here after recording.
                    wire.send(deliver_ack_frame(blob_id))
                    self.delivered.set()
                    if early:
                        self.delivered_early.set()
            except SessionLost:
                pass
            except ProtocolViolation as exc:
                st.violations.append(f"receive: {exc}")
            finally:
                wire.close()
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)
