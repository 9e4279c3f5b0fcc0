"""`relay` command line: one subcommand per process role, plus operator tools.

    relay up          everything on one machine (ingress per protocol, stream, egress, compaction)
    relay ingress     protocol listeners -> landing table of this node (--protocol P: one)
    relay egress      inbox tail -> connected clients, acks
    relay stream      Spark Structured Streaming: landing -> inbox (--master: on a cluster)
    relay spark       a Spark standalone master or worker from the installed pyspark
    relay compact     purge delivered / expired envelopes, compact, checkpoint, vacuum
    relay keys        print the relay's public keys
    relay heya inbox-token   mint Heya inbox tokens (the protocol has no command for it)
    relay status      the relay at a glance: tables, landing lag, each process's /metrics
    relay loadgen     fill a data directory with a realistic synthetic day
    relay bench       measure throughput and latency, write a JSON results file
    relay ppp         PPP client: keygen, send (queued when offline: flush), receive, mail,
                      verify and contacts, backup and recovery-phrase, revoke, rotate-key,
                      rooms, carry groups and the BLE courier (docs/clients/ppp-client.md)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

from runtime import config, logs
from .up import SUPERVISED_ENV, role_env


def _settings(args) -> config.Settings:
    overrides = {}
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = args.data_dir
    return config.load(args.conf, **overrides)


def _ready(role: str):
    def announce(listening: dict[str, str]) -> None:
        # One line on stdout that `relay up` (or a person) reads: where this process listens.
        print(json.dumps({"ready": role, "listening": listening}), flush=True)
    return announce


# --- signals: how a role is told to stop ------------------------------------------------------
# A role started by `relay up` (RELAY_SUPERVISED = the supervisor's pid) ignores SIGINT: Ctrl-C
# in a terminal signals the whole process group, and the supervisor alone decides the stop
# order (relay/up.py). It stops on SIGTERM, or by itself if the supervisor vanished.


def _supervisor() -> int | None:
    pid = os.environ.get(SUPERVISED_ENV, "")
    return int(pid) if pid.isdigit() else None


def _stop_signals() -> tuple[signal.Signals, ...]:
    return (signal.SIGTERM,) if _supervisor() else (signal.SIGINT, signal.SIGTERM)


def _watch_supervisor(stop_soon) -> None:
    pid = _supervisor()
    if pid is None:
        return

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(1.0)
        stop_soon()
    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


def _run_async(main) -> None:
    async def runner():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        if _supervisor():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        for sig in _stop_signals():
            loop.add_signal_handler(sig, stop.set)
        _watch_supervisor(lambda: loop.call_soon_threadsafe(stop.set))
        await main(stop)
        # Stopped: a second SIGTERM (a group signal, then the supervisor's own) must not kill
        # the process on its way out, which closing the loop would allow (SIG_DFL again).
        for sig in _stop_signals():
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
    asyncio.run(runner())


def _with_listener_allocator(command: str) -> None:
    """Re-execute this command (same pid, same arguments) with the environment a listener
    role runs in (`up.role_env`: ALLOCATOR_ENV), unless it has that already."""
    env = role_env(command, os.environ)
    if env.get("PYTHONMALLOC") != os.environ.get("PYTHONMALLOC"):
        os.execve(sys.executable, [sys.executable, "-m", "relay.cli", *sys.argv[1:]], env)


def cmd_ingress(args) -> None:
    from ingress import service
    settings = _settings(args)
    from delta_tables.node_claim import NodeIdTaken
    from delta_tables.node_lease import LeaseLost
    role = config.ingress_role(args.protocol)
    logs.setup(role)
    try:
        _run_async(lambda stop: service.run(settings, stop, _ready(role),
                                            protocol=args.protocol))
    except NodeIdTaken as exc:
        logging.getLogger("relay.ingress").error(str(exc), extra={"event": "node_id_taken"})
        sys.exit(2)
    except LeaseLost as exc:
        logging.getLogger("relay.ingress").error(str(exc), extra={"event": "lease_lost"})
        sys.exit(1)


def cmd_egress(args) -> None:
    from egress import service
    settings = _settings(args)
    logs.setup("egress")
    _run_async(lambda stop: service.run(settings, stop, _ready("egress")))


def cmd_push(args) -> None:
    from egress.push import job
    settings = _settings(args)
    if args.vapid_public_key:
        # What a web app passes to PushManager.subscribe() as applicationServerKey.
        import base64

        from egress.push.providers import vapid_key, vapid_public_key
        key = vapid_public_key(vapid_key(settings.push.webpush, settings.data_dir))
        print(base64.urlsafe_b64encode(key).rstrip(b"=").decode())
        return
    logs.setup("push")
    _run_async(lambda stop: job.main(settings, stop, _ready("push")))


class _StopFlag:
    """A threading.Event set by the stop signals; `install` (re)takes them (pyspark replaces
    the SIGINT handler when it creates a SparkContext, so the stream calls it again then)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.install()
        _watch_supervisor(self.event.set)

    def install(self) -> None:
        if _supervisor():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        for sig in _stop_signals():
            signal.signal(sig, lambda *_: self.event.set())


def cmd_stream(args) -> None:
    from jobs import stream_main
    settings = _settings(args)
    if args.master:
        settings.stream.master = args.master
    logs.setup("stream")
    stop = _StopFlag()
    stream_main.run(settings, stop.event, available_now=args.available_now,
                    ready=_ready("stream"), on_spark_started=stop.install)


def cmd_spark_master(args) -> None:
    from jobs import spark_cluster
    settings = _settings(args)
    spark_cluster.run(spark_cluster.master_command(
        host=args.host, port=args.port, webui_port=args.webui_port, data_dir=settings.data_dir))


def cmd_spark_worker(args) -> None:
    from jobs import spark_cluster
    settings = _settings(args)
    work_dir = args.work_dir or str(settings.data_path / "spark-work")
    spark_cluster.run(spark_cluster.worker_command(
        args.master, host=args.host, cores=args.cores, memory=args.memory,
        webui_port=args.webui_port, work_dir=work_dir, data_dir=settings.data_dir))


def cmd_compact(args) -> None:
    from jobs import compact
    settings = _settings(args)
    logs.setup("compact")
    if args.loop:
        from runtime import metrics
        stop = _StopFlag()
        compaction_metrics = metrics.CompactionMetrics(settings.data_dir)
        exporter = metrics.serve_role(settings, "compact", compaction_metrics.registry)
        metrics.announce(_ready("compact"), exporter, settings.metrics.bind)({})
        # steps are logged (`compaction_step`), like every long-running role's output
        compact.compaction_loop(settings, stop.event,
                                on_report=compaction_metrics.observe,
                                on_failure=compaction_metrics.failed,
                                run=lambda: _compact_in_child(args, stop.event))
        metrics.stop(exporter)
        return
    if args.json:
        report = compact.run_compaction(settings)     # steps are logged on stderr
        print(json.dumps(dataclasses.asdict(report)), flush=True)
        return
    report = compact.run_compaction(settings, progress=lambda m: print(m, flush=True))
    print(report.format())


COMPACT_STOP_GRACE_SECONDS = 45.0   # under `relay up`'s 60 s before it kills a role


def _compact_in_child(args, stop: threading.Event):
    """One compaction run as `relay compact --json` in a child process, its report read back.

    Idle between runs (5 minutes by default), the loop used to hold what its last run's
    delta-rs and Arrow work had allocated: ~32 MiB private of a 49 MiB process (`relay bench
    --startup`). A child gives all of it back, for ~1 s of imports per run. Asked to stop
    mid-run, the loop lets the run finish (Delta commits are atomic either way) for up to
    COMPACT_STOP_GRACE_SECONDS, then kills it. The child has a process group of its own:
    Ctrl-C, or a SIGTERM to the whole group (`timeout`, a service manager), is the loop's to
    handle, as when passes ran in its process; it reached the child first and killed the pass."""
    import subprocess
    from jobs.compact_step import CompactionReport
    argv = [sys.executable, "-m", "relay.cli"] + (["--conf", args.conf] if args.conf else []) + (
        ["--data-dir", args.data_dir] if args.data_dir else []) + ["compact", "--json"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, process_group=0)
    try:
        while proc.poll() is None and not stop.wait(0.5):
            pass
        out, _ = proc.communicate(timeout=COMPACT_STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    finally:
        if proc.poll() is None:    # anything else raised: leave no pass running behind
            proc.kill()
            proc.wait()
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"compaction child exited with {proc.returncode}")
    return CompactionReport(**json.loads(lines[-1]))


def cmd_keys(args) -> None:
    from runtime import keys
    settings = _settings(args)
    key = keys.load_or_create(settings.data_dir)
    print(f"trueseal {key.public_hex}")
    if settings.heya.enabled:
        from runtime import tls
        cert, _ = tls.load_or_create_server_cert(settings.data_dir, settings.heya.cert_file,
                                                 settings.heya.key_file)
        # What a Heya client pins instead of SKIP_VERIFY: SHA-256 of the server certificate.
        print(f"heya-cert-sha256 {tls.cert_digest(tls.server_cert_der(cert)).hex()}")
    if settings.sync.enabled:
        # What a direct cursor-sync client pins (README "cursor-sync").
        from ingress.sync_quic import server_cert_sha256
        print(f"sync-cert-sha256 {server_cert_sha256(settings)}")
        if settings.sync.iroh_enabled:
            # What a stock 0k-sync client dials (docs/protocols/cursor-sync-iroh.md): the
            # endpoint id (kept in <data>/keys/sync_iroh.key) and the direct address.
            from ingress.sync_iroh import endpoint_id
            print(f"sync-iroh-endpoint-id {endpoint_id(settings)}")
            print(f"sync-iroh-address {settings.bind}:{settings.sync.iroh_port}")


def cmd_heya_inbox_token(args) -> None:
    """Print freshly minted inbox tokens, one hex line each, durable in heya_inbox_tokens.
    The operator hands each to one user, who sends `INCO <token>` once from the client
    certificate that is to be the mailbox; the running ingress node accepts it at once."""
    from delta_tables.layout import Layout
    from delta_tables.heya_control import mint_inbox_tokens
    settings = _settings(args)
    for token in mint_inbox_tokens(Layout.of(settings), args.count):
        print(token.hex())


def cmd_status(args) -> None:
    from . import status
    st = status.collect(_settings(args))
    print(status.to_json(st) if args.json else status.format_status(st))


def cmd_loadgen(args) -> None:
    from jobs import loadgen
    settings = _settings(args)
    report = loadgen.generate_day(settings, day=args.day, hours=args.hours, scale=args.scale,
                                  seed=args.seed, compact=args.compact, retain=args.retain,
                                  progress=lambda m: print(m, flush=True))
    print(report.format())
    if args.results and report.storage_after is not None:
        Path(args.results).write_text(json.dumps(report.storage_results(), indent=1) + "\n")
        print(f"storage figures written to {args.results}")


def cmd_up(args) -> None:
    from . import up
    settings = _settings(args)
    logs.setup("up")
    if settings.tables_on_s3:
        # the object store is reachable, the bucket there, the credentials good: or one line
        # and exit 2 here, before any role starts (runtime/operator_errors.py)
        from delta_tables.layout import Layout
        Layout.of(settings).ensure_shared_tables()
    sys.exit(up.run(settings, args.conf))


def cmd_bench(args) -> None:
    if args.peer:
        from .bench import peer
        sys.exit(peer.main(args))
    if args.hosts:
        from .bench import hosts
        sys.exit(hosts.main(args))
    if args.trueseal_netns:
        from .bench import trueseal_netns
        sys.exit(trueseal_netns.main(args))
    if args.startup:
        from .bench import startup
        sys.exit(startup.main(args))
    if args.object_store:
        from .bench import object_store
        sys.exit(object_store.main(args))
    if args.sync_transports:
        from .bench import sync_transports
        sys.exit(sync_transports.main(args))
    if args.state:
        from .bench import state
        sys.exit(state.main(args))
    if args.control_hosts:
        from .bench import control_hosts
        sys.exit(control_hosts.main(args))
    from .bench import run   # the benchmark is loaded by its command only
    sys.exit(run.main(args))


# --- relay ppp: a PPP client for people (the library is relay/ppp_client.py) ---------------

def _ppp_url(args) -> str:
    if args.url:
        return args.url
    from .ppp_client import ws_url
    settings = _settings(args)
    return ws_url(settings.bind, settings.ppp.port, tls=bool(settings.ppp.tls_cert_file))


def _ppp_identity(path: str):
    from . import ppp_client
    if ppp_client.seed_file_too_open(path):
        print(f"warning: {path} is readable by others (chmod 600 it)", file=sys.stderr)
    return ppp_client.read_seed(path)


def _hex_arg(size: int, what: str):
    """An argparse type: exactly `size` bytes written in hex."""
    def parse(text: str) -> bytes:
        try:
            b = bytes.fromhex(text)
        except ValueError:
            b = b""
        if len(b) != size:
            raise argparse.ArgumentTypeError(f"expected {what}: {2 * size} hex characters")
        return b
    return parse


def _int_in(lo: int, hi: int, what: str):
    """An argparse type: an integer in [lo, hi], refused with the range named."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a whole number") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{what} must be in {lo}..{hi}")
        return v
    return parse


_pubkey = _hex_arg(32, "a public key")
_group_id = _hex_arg(16, "a carry group id")


def _ppp_run(fn) -> None:
    """Run one client action; relay refusals and bad input end in one stderr line, exit 1."""
    from engine.ppp.wrap import WrapError
    from .ppp_client import PppError
    try:
        fn()
    except (PppError, WrapError, OSError, ValueError, asyncio.TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def cmd_ppp_keygen(args) -> None:
    from engine.ppp.keys import Identity
    from .ppp_client import write_seed
    ident = Identity.generate()

    def run():
        write_seed(args.out, ident, force=args.force)
        print(json.dumps({"pubkey": ident.pubkey_hex, "seed_file": args.out}) if args.json
              else ident.pubkey_hex)
    _ppp_run(run)


def cmd_ppp_pubkey(args) -> None:
    def run():
        pk = _ppp_identity(args.seed).pubkey_hex
        print(json.dumps({"pubkey": pk}) if args.json else pk)
    _ppp_run(run)


def cmd_ppp_fingerprint(args) -> None:
    from engine.ppp.tokens import display_fingerprint, fingerprint

    def run():
        fp = fingerprint(_ppp_identity(args.seed).pubkey, args.contact)
        print(json.dumps({"contact": args.contact.hex(), "fingerprint": fp,
                          "display": display_fingerprint(fp)}) if args.json
              else display_fingerprint(fp))
    _ppp_run(run)


def cmd_ppp_register_token(args) -> None:
    from .ppp_client import register_token

    def run():
        me = _ppp_identity(args.seed)
        asyncio.run(register_token(_ppp_url(args), me, args.contact))
        print(json.dumps({"registered": True, "contact": args.contact.hex()}))
    _ppp_run(run)


def cmd_ppp_register_push(args) -> None:
    from .ppp_client import register_push

    def run():
        token = args.token if args.token is not None else open(args.token_file).read().strip()
        asyncio.run(register_push(_ppp_url(args), _ppp_identity(args.seed), args.platform,
                                  token))
        print(json.dumps({"registered": True, "platform": args.platform}))   # never the token
    _ppp_run(run)


def _ppp_device(args):
    from .ppp_device import Device
    return Device.beside(args.seed, getattr(args, "state", None))


def cmd_ppp_send(args) -> None:
    """Build the event, flush what was queued before it, then deliver it: sealed falls back
    to STORE (§6.3); no relay reachable queues it in the device's outbox (§12)."""
    from .ppp_client import (Outbox, PppUnreachable, build_blinded, build_presence, deliver,
                             sender_delivery_token)

    def run():
        me = _ppp_identity(args.seed)
        url, outbox = _ppp_url(args), Outbox(_ppp_device(args))
        presence_id = uuid.uuid4().bytes                 # what `relay ppp revoke` names
        opts = dict(lat=args.lat, lon=args.lon, radius_m=args.radius, ttl=args.ttl,
                    presence_id=presence_id)
        if args.blinded:
            gw, token = build_blinded(me, args.to, args.text, **opts)
        else:
            gw = build_presence(me, args.to, args.text, **opts)
            token = bytes.fromhex(args.token) if args.token else sender_delivery_token(me,
                                                                                       args.to)
        sealed = args.sealed or bool(args.token)
        token = token if sealed else None

        async def go():
            if outbox.entries():
                for line in await outbox.flush(url, me):
                    if not line.get("queued"):
                        print(json.dumps(line))
            try:
                return {**(await deliver(url, me, gw, token=token,
                                         fallback=not args.no_fallback)).to_json(),
                        "presence_id": presence_id.hex()}
            except PppUnreachable as e:
                outbox.add(gw, token=token, error=str(e), now=int(time.time()),
                           blinded_for=args.to if args.blinded else None)
                print("relay unreachable: queued (relay ppp flush sends it)",
                      file=sys.stderr)
                return {"event_id": gw.event_id.hex(), "queued": True,
                        "presence_id": presence_id.hex()}
        print(json.dumps(asyncio.run(go())))
    _ppp_run(run)


def cmd_ppp_flush(args) -> None:
    """Send what the outbox holds; `--wait` keeps retrying (backoff) until it is empty."""
    from .ppp_client import Outbox

    def run():
        me, outbox = _ppp_identity(args.seed), Outbox(_ppp_device(args))
        if args.wait:
            lines = asyncio.run(outbox.flush_until_empty(_ppp_url(args), me, wait=args.wait))
        else:
            lines = asyncio.run(outbox.flush(_ppp_url(args), me))
        for line in lines:
            print(json.dumps(line))
    _ppp_run(run)


def cmd_ppp_receive(args) -> None:
    from .ppp_client import apply_received, receive, receive_blinded, receive_polling

    def run():
        me = _ppp_identity(args.seed)
        device = _ppp_device(args)
        if args.blinded:
            if not args.contact:
                raise ValueError("--blinded needs --contact (one per contact)")
            state = device.load("blinded", {})
            got = asyncio.run(receive_blinded(_ppp_url(args), me, args.contact, ack=args.ack,
                                              state=state))
            device.save("blinded", state)
        elif args.http:
            got = asyncio.run(receive_polling(_ppp_url(args), me, since=args.since,
                                              ack=args.ack))
        else:
            got = asyncio.run(receive(_ppp_url(args), me, since=args.since, ack=args.ack))
        lines = []
        for r in got:
            if r.opened is not None and args.here:
                region = getattr(r.opened.rumor.content, "region", None)
                if region is not None:
                    r.extra["inside"] = region.contains(*args.here)
            lines.append(r.to_json())
            print(json.dumps(lines[-1], ensure_ascii=False))
        device.append_mail([{k: v for k, v in line.items() if k not in ("acked", "inside")}
                            for line in lines])
        for notice in apply_received(device, me, got):
            print(json.dumps({"notice": notice}))
            change = notice.get("key_change")
            if change and change["severity"] == "warning":
                print(f"WARNING: {change['contact_id']}: {change['advice']} "
                      f"(relay ppp contacts approve --name {change['contact_id']})",
                      file=sys.stderr)
    _ppp_run(run)


def _phrase(args) -> str:
    if args.phrase_file:
        text = sys.stdin.read() if args.phrase_file == "-" else open(args.phrase_file).read()
        return " ".join(text.split())
    raise ValueError("give the recovery phrase with --phrase-file FILE (or - for stdin)")


def cmd_ppp_recovery_phrase(args) -> None:
    """The 24-word BIP-39 phrase of the seed: the one thing to write down."""
    from engine.ppp.backup import mnemonic_of

    def run():
        print("write these words down; anyone who has them is you", file=sys.stderr)
        print(mnemonic_of(_ppp_identity(args.seed)))
    _ppp_run(run)


def cmd_ppp_backup(args) -> None:
    """`relay ppp backup create|show|delete|restore`: one JSON line."""
    from . import ppp_client as P
    from .ppp_device import Device

    def run():
        url = _ppp_url(args)
        if args.backup_command == "restore":
            me, snap, meta = asyncio.run(P.backup_restore(url, _phrase(args),
                                                          passphrase=args.passphrase))
            P.write_seed(args.out, me, force=args.force)
            device = Device.beside(args.out, args.state)
            if snap is not None:
                device.restore(snap)
            print(json.dumps({"pubkey": me.pubkey_hex, "restored": snap is not None,
                              **(meta or {}), "mail": len(device.mail()),
                              "contacts": len(device.load("contacts", {}))}))
            return
        me = _ppp_identity(args.seed)
        if args.backup_command == "create":
            from engine.ppp.backup import mnemonic_of
            phrase = _phrase(args) if args.phrase_file else mnemonic_of(me)
            out = asyncio.run(P.backup_create(url, me, phrase, _ppp_device(args).snapshot(),
                                              passphrase=args.passphrase))
        elif args.backup_command == "show":
            out = asyncio.run(P.backup_show(url, me)) or {"backup": None}
        else:
            async def delete():
                async with await P.PppClient.connect(url, me) as c:
                    await c.delete_backup()
            asyncio.run(delete())
            out = {"deleted": True}
        print(json.dumps(out))
    _ppp_run(run)          # BackupError is a ValueError: one line on stderr, exit 1


def cmd_ppp_verify(args) -> None:
    """`relay ppp verify invite|accept|complete` (§9 OOB verification): one JSON line."""
    from engine.ppp import verify as V
    from .ppp_client import http_base

    def run():
        me, device = _ppp_identity(args.seed), _ppp_device(args)
        now = int(time.time())
        contacts = device.load("contacts", {})
        level = 2 if getattr(args, "in_person", False) else 1
        if args.verify_command == "invite":
            relay_url = args.relay_url or http_base(_ppp_url(args))
            inv = V.Invite.make(me, relay_url, now)
            pending = {t: r for t, r in device.load("invites", {}).items()
                       if now - r["issued_at"] <= V.INVITE_TTL}       # expired ones go
            pending[inv.invite_token.hex()] = {"issued_at": now, "relay_url": relay_url}
            device.save("invites", pending)
            out = {"invite_url": inv.url(args.domain), "expires_at": now + V.INVITE_TTL}
        elif args.verify_command == "accept":
            inv = V.Invite.parse(args.invite, now)
            if inv.sender_pk == me.pubkey:
                raise V.VerifyError("that is my own invite")
            change = V.pin(contacts, args.name, inv.sender_pk, level=level, via=args.via,
                           now=now, relay_url=inv.relay_url)
            out = {"accept_url": V.Accept.make(me, inv).url(args.domain),
                   "contact": args.name, "pubkey": inv.sender_pk.hex(), "level": level}
            if change:
                out["key_change"] = dataclasses.asdict(change)
        else:
            acc = V.Accept.parse(args.accept)
            pending = device.load("invites", {})
            rec = V.check_accept(me, acc, pending, now)
            device.save("invites", pending)                            # single use
            change = V.pin(contacts, args.name, acc.responder_pk, level=level, via=args.via,
                           now=now, relay_url=rec.get("relay_url", ""))
            out = {"contact": args.name, "pubkey": acc.responder_pk.hex(), "level": level,
                   "fingerprint": _fingerprint(me.pubkey, acc.responder_pk)}
            if change:
                out["key_change"] = dataclasses.asdict(change)
        device.save("contacts", contacts)
        print(json.dumps(out))
    _ppp_run(run)


def _fingerprint(a: bytes, b: bytes) -> str:
    from engine.ppp.tokens import display_fingerprint, fingerprint
    return display_fingerprint(fingerprint(a, b))


def cmd_ppp_contacts(args) -> None:
    """`relay ppp contacts [list|add|approve]`: pinned contacts, never sent to the relay."""
    from engine.ppp import verify as V

    def run():
        device = _ppp_device(args)
        contacts = device.load("contacts", {})
        action = args.contacts_command or "list"
        if action == "list":
            me = _ppp_identity(args.seed)
            for c in contacts.values():
                print(json.dumps({**c, "level_name": V.LEVELS[c["verification_level"]],
                                  "fingerprint": _fingerprint(me.pubkey,
                                                              bytes.fromhex(c["pubkey"]))}))
            return
        if action == "add":
            change = V.pin(contacts, args.name, args.pubkey, level=0, via=args.via,
                           now=int(time.time()))
            out = {"contact": args.name, "level": contacts[args.name]["verification_level"]}
            if change:
                out["key_change"] = dataclasses.asdict(change)
        else:
            if args.name not in contacts:
                raise ValueError(f"no contact named {args.name}")
            out = V.approve(contacts, args.name, int(time.time()))
        device.save("contacts", contacts)
        print(json.dumps(out))
    _ppp_run(run)


def cmd_ppp_event(args) -> None:
    """`relay ppp revoke|rotate-key|key-exchange-return`: a §4.3 event of that kind."""
    from engine.ppp import verify as V
    from engine.ppp.wrap import Kind
    from .ppp_client import (build_event, deliver, key_exchange_return_content,
                             revoke_content)

    def run():
        me = _ppp_identity(args.seed)
        if args.ppp_command == "revoke":
            events = [(args.to, Kind.REVOKE, revoke_content(args.presence_id))]
        elif args.ppp_command == "key-exchange-return":
            events = [(args.to, Kind.KEY_EXCHANGE_RETURN,
                       key_exchange_return_content(me, args.to))]
        else:
            new = _ppp_identity(args.new_seed)
            content = V.key_rotation_content(me, new.pubkey)
            recipients = args.to or [bytes.fromhex(c["pubkey"]) for c in
                                     _ppp_device(args).load("contacts", {}).values()]
            events = [(pk, Kind.KEY_ROTATION, content) for pk in recipients]

        async def go():
            for to, kind, content in events:
                r = await deliver(_ppp_url(args), me, build_event(me, to, kind, content))
                print(json.dumps({"to": to.hex(), "kind": kind.name, **r.to_json()}))
        asyncio.run(go())
    _ppp_run(run)


def cmd_ppp_mail(args) -> None:
    """The mail this device has received and kept (JSON lines), newest last."""
    def run():
        for m in _ppp_device(args).mail():
            print(json.dumps(m, ensure_ascii=False))
    _ppp_run(run)


def cmd_ppp_carry(args) -> None:
    """`relay ppp carry register|leave|invite|accept`: one JSON line."""
    from .ppp_client import PppClient, build_event, deliver

    async def act(me):
        if args.carry_command in ("invite", "accept"):
            from engine.ppp.wrap import Kind
            if args.carry_command == "invite":       # §4.3 CarryGroupInviteContent
                kind, content = Kind.CARRY_GROUP_INVITE, {
                    "group_id": args.group, "group_name": args.name,
                    "members": list(args.member), "couriers": list(args.courier)}
            else:                                    # §8: consent, named by pubkey
                kind, content = Kind.CARRY_GROUP_ACCEPT, {"group_id": args.group,
                                                         "pubkey": me.pubkey}
            out = []
            for to in args.to:
                r = await deliver(_ppp_url(args), me, build_event(me, to, kind, content))
                out.append({"to": to.hex(), "kind": kind.name, **r.to_json()})
            return out[0] if len(out) == 1 else out
        async with await PppClient.connect(_ppp_url(args), me) as c:
            if args.carry_command == "leave":
                await c.leave_carry_group(args.group)
                return {"left": args.group.hex()}
            group = args.group or os.urandom(16)
            await c.register_carry_group(group, args.member, args.courier)
            return {"registered": group.hex(), "members": len(args.member),
                    "couriers": len(args.courier)}

    _ppp_run(lambda: print(json.dumps(asyncio.run(act(_ppp_identity(args.seed))))))


# Exit status of the BLE commands where the machine has no Bluetooth (README).
NO_BLUETOOTH = 3


def cmd_ppp_courier(args) -> None:
    """Fetch for my carry groups while online, then serve what I carry over BLE."""
    from . import courier, courier_ble

    def run():
        me = _ppp_identity(args.seed)
        store = courier.load_store(args.store)
        report = {}
        if not args.offline:
            report.update(asyncio.run(courier.sync_with_relay(
                _ppp_url(args), me, args.group, store)).to_json())
            courier.save_store(args.store, store)
        carrying = [e for e in store.events.values() if not e.delivered]
        report["carrying"] = len(carrying)
        if args.no_serve:
            print(json.dumps(report))
            return
        if args.loopback:
            gatt = courier_ble.CourierGatt(
                store, carried_for=frozenset(e.recipient for e in carrying),
                couriers=frozenset(args.courier or ()), mtu=args.mtu)
            try:
                lines = asyncio.run(_loopback_handover(gatt, args.loopback))
            finally:
                courier.save_store(args.store, store)
            for line in lines:
                print(json.dumps(line, ensure_ascii=False))
            report.update(delivered=len(gatt.delivered), handed_on=len(gatt.handed_on))
            print(json.dumps(report))
            return
        absent = courier_ble.bluetooth_absent()
        if absent is not None:
            print(json.dumps(report))
            print(f"error: {absent}: nothing served (the events stay in {args.store})",
                  file=sys.stderr)
            sys.exit(NO_BLUETOOTH)
        gatt = courier_ble.CourierGatt(
            store, carried_for=frozenset(e.recipient for e in carrying),
            couriers=frozenset(args.courier or ()), mtu=args.mtu)

        async def serve():
            stop = asyncio.sleep(args.serve_seconds) if args.serve_seconds else None
            await courier_ble.serve_bless(gatt, stop=stop)
        try:
            asyncio.run(serve())
        finally:
            courier.save_store(args.store, store)
        report.update(delivered=len(gatt.delivered), handed_on=len(gatt.handed_on))
        print(json.dumps(report))
    _ppp_run(run)


async def _loopback_handover(gatt, seeds: list[str]) -> list[dict]:
    """The BLE hand-over without Bluetooth: each recipient (a seed file) runs the central's
    side against this courier over `LoopbackLink`, the same reads, writes, notifications
    and MTU-sized chunks as on the air; what each received is opened and verified."""
    from engine.ppp.courier import RecipientSession
    from nacl.signing import SigningKey
    from . import courier_ble
    from .ppp_client import open_event
    out = []
    for path in seeds:
        me = _ppp_identity(path)
        side = RecipientSession(SigningKey(me.seed))
        try:
            await courier_ble.receive(courier_ble.LoopbackLink(gatt), side, idle=0.5)
        except courier_ble.GattRefused:
            out.append({"recipient": me.pubkey_hex, "refused": "nothing carried for it"})
            continue
        for gw in side.received.values():
            out.append({"recipient": me.pubkey_hex, **open_event(gw.encode(), me).to_json()})
    return out


def cmd_ppp_courier_receive(args) -> None:
    """Scan for a courier, authenticate, receive, verify; optionally ACK to the relay."""
    from engine.ppp.courier import RecipientSession
    from nacl.signing import SigningKey
    from . import courier_ble
    from .ppp_client import PppClient, open_event

    def run():
        me = _ppp_identity(args.seed)
        absent = courier_ble.bluetooth_absent()
        if absent is not None:
            print(f"error: {absent}", file=sys.stderr)
            sys.exit(NO_BLUETOOTH)
        side = RecipientSession(SigningKey(me.seed))
        asyncio.run(courier_ble.scan_and_receive(side, timeout=args.timeout))
        opened = [open_event(gw.encode(), me) for gw in side.received.values()]
        for r in opened:
            print(json.dumps(r.to_json(), ensure_ascii=False))
        if args.ack and side.received:
            async def ack():
                async with await PppClient.connect(_ppp_url(args), me) as c:
                    await c.ack(list(side.received))
            asyncio.run(ack())
    _ppp_run(run)


def cmd_ppp_room(args) -> None:
    """`relay ppp room <action>`: one JSON line (or one per room / message) on stdout."""
    from . import ppp_rooms as R
    from engine.ppp.room_crypto import my_member_token

    def run():
        me = _ppp_identity(args.seed)
        url = _ppp_url(args)
        act = args.room_command
        if act == "create":
            if args.group:
                room = asyncio.run(R.create_group(url, me, gated=not args.open,
                                                  max_members=args.max_members, out=args.out))
            elif args.lat is None or args.lon is None:
                raise ValueError("a room needs --lat and --lon (or --group)")
            else:
                room = asyncio.run(R.create(url, me, args.lat, args.lon, ttl=args.ttl,
                                            gated=not args.open, max_members=args.max_members,
                                            ble=args.ble, out=args.out))
            print(json.dumps({"room_id": room.room_id.hex(), "room_file": args.out}))
        elif act == "discover":
            for info in asyncio.run(R.discover(url, me, args.lat, args.lon)):
                print(json.dumps(R.room_info_json(info)))
        elif act == "knock":
            room_id = bytes.fromhex(args.room_id)
            if len(room_id) != 16:
                raise ValueError("a room id is 32 hex characters")
            room = asyncio.run(R.knock(url, me, room_id, args.out, handle=args.handle,
                                       wait=args.wait))
            print(json.dumps({"room_file": args.out, "member_token": my_member_token(
                me, room.room_key, room.room_id).hex()}))
        elif act == "join":
            for line in asyncio.run(R.join(url, me, args.out_dir)):
                print(json.dumps(line))
        else:
            room = R.RoomFile.read(args.room)
            if act == "token":
                print(json.dumps({"member_token": my_member_token(
                    me, room.room_key, room.room_id).hex()}))
            elif act == "register":
                token = bytes.fromhex(args.token)
                if len(token) != 12:
                    raise ValueError("a member token is 24 hex characters")
                asyncio.run(R.register(url, me, room, token))
                print(json.dumps({"registered": True}))
            elif act == "send":
                seq = asyncio.run(R.send(url, me, room, args.text, sealed=args.sealed))
                print(json.dumps({"room_id": room.room_id.hex(), "sequence_number": seq}))
            elif act == "fetch":
                for line in asyncio.run(R.fetch(url, me, room, args.since_id)):
                    print(json.dumps(line, ensure_ascii=False))
            elif act == "rotate":
                _, reply = asyncio.run(R.rotate(url, me, room, args.grace, args.out))
                print(json.dumps({"revoked_count": reply["revoked_count"],
                                  "grace_until": reply["grace_until"], "room_file": args.out}))
            elif act == "revoke":
                print(json.dumps({"revoked": asyncio.run(R.revoke(url, me, room))}))
            elif act == "admit":
                for line in asyncio.run(R.admit(url, me, room, count=args.count,
                                                wait=args.wait)):
                    print(json.dumps(line))
            elif act == "invite":
                eid = asyncio.run(R.invite(url, me, room, args.to, args.name))
                print(json.dumps({"event_id": eid.hex(), "to": args.to.hex()}))
            elif act in ("update", "kick", "ban"):
                print(json.dumps(asyncio.run(_room_admin(url, me, room.room_id, args))))
    _ppp_run(run)


async def _room_admin(url: str, me, room_id: bytes, args) -> dict:
    """`relay ppp room update|kick|ban`: the admin's calls (§7.1 UPDATE_ROOM, §7.7)."""
    from .ppp_client import PppClient
    async with await PppClient.connect(url, me) as c:
        if args.room_command == "update":
            flags = {"gated": args.gated, "proximity_required": args.proximity_required}
            await c.update_room(room_id, **flags)
            return {"room_id": room_id.hex(), "updated": {k: v for k, v in flags.items()
                                                          if v is not None}}
        call = c.kick_member if args.room_command == "kick" else c.ban_member
        await call(room_id, args.member, args.reason)
        return {"room_id": room_id.hex(), "member": args.member.hex(),
                ("kicked" if args.room_command == "kick" else "banned"): True}


def cmd_ppp_discover_contacts(args) -> None:
    from .ppp_client import discover_contacts

    def lines(path: str | None) -> list[str]:
        if not path:
            return []
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
        return [x.strip() for x in text.splitlines() if x.strip() and not x.startswith("#")]

    def run():
        me = _ppp_identity(args.seed)
        for line in asyncio.run(discover_contacts(_ppp_url(args), me, lines(args.contacts),
                                                  list(args.publish or ()))):
            print(json.dumps(line, ensure_ascii=False))
    _ppp_run(run)


def _add_room_parser(pp, url_help: str) -> None:
    room = pp.add_parser("room", help="rooms (§7): create, discover, members, messages")
    rp = room.add_subparsers(dest="room_command", required=True)

    def action(name: str, help: str, *, room_file: bool = True):
        p = rp.add_parser(name, help=help)
        p.add_argument("--seed", required=True, help="your seed file")
        if room_file:
            p.add_argument("--room", required=True, help="room file (id and key, JSON, 0600)")
        p.add_argument("--url", help=url_help)
        p.set_defaults(func=cmd_ppp_room)
        return p
    p = action("create", "create a room where you are (or --group); writes the room file",
               room_file=False)
    p.add_argument("--lat", type=float)
    p.add_argument("--lon", type=float)
    p.add_argument("--group", action="store_true",
                   help="a group (§7.6): no place, never discovered, lives until deleted")
    p.add_argument("--out", required=True, help="room file to create")
    p.add_argument("--ttl", type=_int_in(1, 30 * 86_400, "--ttl"), default=86_400,
                   help="seconds the room lives (default 1 day)")
    p.add_argument("--max-members", type=_int_in(1, 100, "--max-members"), default=100,
                   help="1-100 (default 100)")
    p.add_argument("--open", action="store_true",
                   help="not gated: any authenticated user may STORE_ROOM")
    p.add_argument("--ble", action="store_true", help="allow knock / admit")
    p = action("discover", "rooms around a position (its cell and the 8 around it)",
               room_file=False)
    p.add_argument("--lat", type=float, required=True)
    p.add_argument("--lon", type=float, required=True)
    action("token", "print your member token for the room's admin to register")
    p = action("register", "admin: register a member's token")
    p.add_argument("--token", required=True, help="the member's token (24 hex)")
    p = action("send", "send a message (authenticated, or --sealed anonymous HTTP)")
    p.add_argument("--text", required=True)
    p.add_argument("--sealed", action="store_true", help="POST /v1/room/submit with your token")
    p = action("fetch", "fetch and decrypt messages (JSON lines)")
    p.add_argument("--since-id", type=int, default=0, help="after this sequence number")
    p = action("rotate", "admin: new room key; old tokens valid for --grace seconds")
    p.add_argument("--grace", type=_int_in(0, 600, "--grace"), default=300,
                   help="0-600 s (default 300)")
    p.add_argument("--out", required=True, help="new room file (the new key)")
    action("revoke", "admin: revoke every member token of the room")
    p = action("knock", "ask a room's admin in (§7.4); writes the room file once admitted",
               room_file=False)
    p.add_argument("--room-id", required=True, help="the room id (32 hex), e.g. from discover")
    p.add_argument("--handle", help="a name the admin sees with the knock")
    p.add_argument("--out", required=True, help="room file to write")
    p.add_argument("--wait", type=float, default=120.0, help="seconds (a knock lives 120)")
    p = action("admit", "admin: wait for knocks and admit them (the key, encrypted to each)")
    p.add_argument("--count", type=int, default=1, help="knocks to admit (default 1)")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for each")
    p = action("invite", "admin: send a GroupInvite (§7.6) to a contact")
    p.add_argument("--to", required=True, type=_pubkey, help="contact public key (hex)")
    p.add_argument("--name", default="", help="group name shown to the invitee")
    p = action("update", "admin: change the room's flags (UPDATE_ROOM)")
    p.add_argument("--gated", action=argparse.BooleanOptionalAction, default=None,
                   help="members only (--no-gated: any authenticated user)")
    p.add_argument("--proximity-required", action=argparse.BooleanOptionalAction,
                   default=None, help="reserved by §7.1 for future use")
    for name, text in (("kick", "admin: kick a member (KICK_MEMBER; they may knock again)"),
                       ("ban", "admin: ban a member for good (BAN_MEMBER)")):
        p = action(name, text + "; the relay must have moderation on (§7.7)")
        p.add_argument("--member", required=True, type=_pubkey, help="member public key")
        p.add_argument("--reason", help="shown to nobody but the relay's reply")
    p = action("join", "room files from the GroupInvites sent to you", room_file=False)
    p.add_argument("--out-dir", required=True, help="where to write <room id>.json")


def _add_courier_parsers(pp, url_help: str) -> None:
    carry = pp.add_parser("carry", help="carry groups (§8): who may carry my events offline")
    cs = carry.add_subparsers(dest="carry_command", required=True)
    p = cs.add_parser("register", help="register a carry group (as its owner the first time), "
                                       "or consent to one as a listed member")
    p.add_argument("--seed", required=True)
    p.add_argument("--group", type=_group_id, help="the group id (32 hex); default: a new one")
    p.add_argument("--member", action="append", type=_pubkey, required=True, metavar="PUBKEY",
                   help="a member whose events may be carried (repeat)")
    p.add_argument("--courier", action="append", type=_pubkey, required=True, metavar="PUBKEY",
                   help="a courier who may fetch them (repeat)")
    p.add_argument("--url", help=url_help)
    p.set_defaults(func=cmd_ppp_carry)
    for name, text, to_help in (
            ("invite", "invite members to a carry group (CARRY_GROUP_INVITE, gift-wrapped to "
                       "each --to)", "who receives the invite (repeat)"),
            ("accept", "accept a carry-group invite (CARRY_GROUP_ACCEPT to the inviter); then "
                       "`carry register` gives the relay consent", "the inviter")):
        p = cs.add_parser(name, help=text)
        p.add_argument("--seed", required=True)
        p.add_argument("--group", type=_group_id, required=True)
        p.add_argument("--to", action="append", type=_pubkey, required=True, metavar="PUBKEY",
                       help=to_help)
        p.add_argument("--url", help=url_help)
        p.set_defaults(func=cmd_ppp_carry)
        if name == "invite":
            p.add_argument("--name", default="", help="the group's name, shown to the invitee")
            p.add_argument("--member", action="append", type=_pubkey, required=True,
                           metavar="PUBKEY")
            p.add_argument("--courier", action="append", type=_pubkey, required=True,
                           metavar="PUBKEY")
    p = cs.add_parser("leave", help="leave a carry group (its owner: dissolve it)")
    p.add_argument("--seed", required=True)
    p.add_argument("--group", type=_group_id, required=True)
    p.add_argument("--url", help=url_help)
    p.set_defaults(func=cmd_ppp_carry)
    p = pp.add_parser("courier", help="fetch my carry groups' events while online, then hand "
                                      "them over BLE to their recipients (a GATT server)")
    p.add_argument("--seed", required=True)
    p.add_argument("--group", type=_group_id, action="append", default=[],
                   help="a carry group I am a courier of (repeat)")
    p.add_argument("--store", required=True, help="file of carried events (0600)")
    p.add_argument("--courier", action="append", type=_pubkey, metavar="PUBKEY",
                   help="another courier of my groups, who may take events on (a hop)")
    p.add_argument("--offline", action="store_true", help="do not contact the relay")
    p.add_argument("--no-serve", action="store_true", help="fetch and report only")
    p.add_argument("--loopback", action="append", metavar="SEED_FILE",
                   help="no Bluetooth: hand over in this process to the recipient whose seed "
                        "file this is, over an in-memory GATT link (repeat; to try it out)")
    p.add_argument("--serve-seconds", type=float, help="stop serving after this long")
    p.add_argument("--mtu", type=_int_in(23, 517, "--mtu"), default=23,
                   help="ATT MTU to chunk for, 23..517 (default 23: every link has it)")
    p.add_argument("--url", help=url_help)
    p.set_defaults(func=cmd_ppp_courier)
    p = pp.add_parser("courier-receive", help="find a courier over BLE, receive my events, "
                                              "verify and print them (JSON lines)")
    p.add_argument("--seed", required=True)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to scan")
    p.add_argument("--ack", action="store_true", help="then ACK them to the relay (online)")
    p.add_argument("--url", help=url_help)
    p.set_defaults(func=cmd_ppp_courier_receive)


def _add_ppp_parser(sub) -> None:
    ppp = sub.add_parser("ppp", help="PPP client: keys, tokens, send and receive events")
    pp = ppp.add_subparsers(dest="ppp_command", required=True)
    url_help = "relay WebSocket URL (default: ws://<bind>:<ppp.port>/v1/ws from the settings)"
    state_help = ("this device's state directory: contacts, outbox, received mail "
                  "(default: <seed file>.d)")
    p = pp.add_parser("keygen", help="new identity: seed file (0600), prints the public key")
    p.add_argument("--out", required=True, help="seed file to create")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the hex")
    p.set_defaults(func=cmd_ppp_keygen)
    p = pp.add_parser("pubkey", help="print the public key of a seed file")
    p.add_argument("--seed", required=True)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the hex")
    p.set_defaults(func=cmd_ppp_pubkey)
    p = pp.add_parser("fingerprint", help="verification fingerprint with a contact (§9)")
    p.add_argument("--seed", required=True)
    p.add_argument("--contact", required=True, type=_pubkey, help="contact public key (hex)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object (the base64 fingerprint and its display form)")
    p.set_defaults(func=cmd_ppp_fingerprint)
    p = pp.add_parser("register-token",
                      help="let a contact send to you sealed: register your pair's delivery token")
    p.add_argument("--seed", required=True)
    p.add_argument("--contact", required=True, type=_pubkey, help="contact public key (hex)")
    p.add_argument("--url", help=url_help)
    p.set_defaults(func=cmd_ppp_register_token)
    p = pp.add_parser("register-push",
                      help="wake this identity's device through APNs, FCM or Web Push while it "
                           "is offline (REGISTER_PUSH)")
    p.add_argument("--seed", required=True)
    p.add_argument("--platform", required=True, choices=["apns", "fcm", "webpush"])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--token", help="the device token (APNs hex, FCM registration token)")
    g.add_argument("--token-file", help="a file holding the token (a Web Push subscription's "
                                        "JSON, say)")
    p.add_argument("--url", help=url_help)
    p.set_defaults(func=cmd_ppp_register_push)
    p = pp.add_parser("send", help="send a PRESENCE event (WebSocket STORE, or sealed HTTP)")
    p.add_argument("--seed", required=True)
    p.add_argument("--to", required=True, type=_pubkey, help="recipient public key (hex)")
    p.add_argument("--text", required=True, help="message text")
    p.add_argument("--lat", type=float, default=0.0, help="region centre latitude (default 0)")
    p.add_argument("--lon", type=float, default=0.0, help="region centre longitude (default 0)")
    p.add_argument("--radius", type=_int_in(10, 50_000, "--radius"), default=50_000,
                   help="region radius in metres, 10..50000 (default 50000)")
    p.add_argument("--ttl", type=_int_in(1, 30 * 86_400, "--ttl"), default=7 * 86_400,
                   help="seconds, up to 30 days (C.2 MAX_EVENT_TTL_SECS; default 7 days)")
    p.add_argument("--sealed", action="store_true",
                   help="anonymous POST /v1/note/submit with the pair's delivery token")
    p.add_argument("--token", help="delivery token (24 hex) instead of the derived one")
    p.add_argument("--no-fallback", action="store_true",
                   help="with --sealed: fail rather than fall back to authenticated STORE "
                        "(which shows the relay who sends)")
    p.add_argument("--blinded", action="store_true",
                   help="to the recipient's blinded mailbox of today (its per-contact daily "
                        "id, unlinkable by the relay); with --sealed, that mailbox's token")
    p.add_argument("--url", help=url_help)
    p.add_argument("--state", help=state_help)
    p.set_defaults(func=cmd_ppp_send)
    p = pp.add_parser("flush", help="send the events queued while no relay was reachable")
    p.add_argument("--seed", required=True)
    p.add_argument("--wait", type=float, default=0.0,
                   help="keep retrying (backoff from 1 s to 60 s) up to this many seconds")
    p.add_argument("--url", help=url_help)
    p.add_argument("--state", help=state_help)
    p.set_defaults(func=cmd_ppp_flush)
    p = pp.add_parser("recovery-phrase", help="print the 24-word BIP-39 recovery phrase of a "
                                              "seed file (write it down)")
    p.add_argument("--seed", required=True)
    p.set_defaults(func=cmd_ppp_recovery_phrase)
    backup = pp.add_parser("backup", help="encrypted backups on the relay (§6): create, show, "
                                          "delete, restore on a new device from the phrase")
    bs = backup.add_subparsers(dest="backup_command", required=True)
    for name, text in (("create", "encrypt this device's contacts, outbox and mail under the "
                                  "recovery phrase's key and store it (replaces the last)"),
                       ("show", "the relay's backup: version, stored_at, size"),
                       ("delete", "delete the relay's backup"),
                       ("restore", "a new device: the identity from the recovery phrase, "
                                   "then the relay's backup opened into its state")):
        b = bs.add_parser(name, help=text)
        b.add_argument("--state", help=state_help)
        b.add_argument("--url", help=url_help)
        b.add_argument("--passphrase", default="", help="BIP-39 passphrase, if one is used")
        b.set_defaults(func=cmd_ppp_backup)
        if name != "restore":
            b.add_argument("--seed", required=True)
            b.add_argument("--phrase-file", help="the recovery phrase (default: from the seed)")
    b.add_argument("--phrase-file", required=True, help="file with the 24 words ('-': stdin)")
    b.add_argument("--out", required=True, help="seed file to create")
    b.add_argument("--force", action="store_true", help="overwrite an existing seed file")
    verify = pp.add_parser("verify", help="out-of-band verification of a contact (§9): "
                                          "invite, accept, complete")
    vs = verify.add_subparsers(dest="verify_command", required=True)
    for name, text in (("invite", "make a signed, single-use invite URL (24 h) to send over "
                                  "a channel you trust"),
                       ("accept", "check a contact's invite URL, pin them, and make the "
                                  "signed accept URL to send back"),
                       ("complete", "check the accept URL for my invite and pin the contact")):
        v = vs.add_parser(name, help=text)
        v.add_argument("--seed", required=True)
        v.add_argument("--state", help=state_help)
        v.add_argument("--domain", default="ppp.invalid",
                       help="host the invite/accept links name (default ppp.invalid)")
        if name == "invite":
            v.add_argument("--relay-url", help="the relay URL to give (default: --url's)")
            v.add_argument("--url", help=url_help)
        else:
            v.add_argument("--" + ("invite" if name == "accept" else "accept"), required=True,
                           help="the URL received")
            v.add_argument("--name", required=True, help="what you call this contact")
            v.add_argument("--via", default="oob", help="the channel used (iMessage, QR, ...)")
            v.add_argument("--in-person", action="store_true",
                           help="done face to face (QR, fingerprint read aloud): level 2")
        v.set_defaults(func=cmd_ppp_verify)
    contacts = pp.add_parser("contacts", help="pinned contacts and their verification level "
                                              "(local only); add; approve a changed key")
    p = contacts
    p.add_argument("--seed", required=True)
    p.add_argument("--state", help=state_help)
    p.set_defaults(func=cmd_ppp_contacts, contacts_command=None)
    cs = contacts.add_subparsers(dest="contacts_command")
    c = cs.add_parser("add", help="pin a key learnt without verification (level 0)")
    c.add_argument("--name", required=True)
    c.add_argument("--pubkey", required=True, type=_pubkey)
    c.add_argument("--via", default="manual")
    c = cs.add_parser("approve", help="accept a verified contact's changed key (back to "
                                      "level 0 until verified again)")
    c.add_argument("--name", required=True)
    for name, text in (("revoke", "revoke a PRESENCE event I sent (REVOKE, §4.3)"),
                       ("rotate-key", "announce my new key to my contacts (KEY_ROTATION, "
                                      "signed by the old key)"),
                       ("key-exchange-return", "return my key to the initiator of a "
                                               "deep-link exchange (KEY_EXCHANGE_RETURN)")):
        p = pp.add_parser(name, help=text)
        p.add_argument("--seed", required=True)
        p.add_argument("--state", help=state_help)
        p.add_argument("--url", help=url_help)
        if name == "rotate-key":
            p.add_argument("--new-seed", required=True, help="the new identity's seed file")
            p.add_argument("--to", action="append", type=_pubkey, metavar="PUBKEY",
                           help="a contact to tell (repeat; default: every pinned contact)")
        else:
            p.add_argument("--to", required=True, type=_pubkey, help="recipient (hex)")
        if name == "revoke":
            p.add_argument("--presence-id", required=True, type=_hex_arg(16, "a presence id"),
                           help="the presence_id of the event (32 hex)")
        p.set_defaults(func=cmd_ppp_event)
    p = pp.add_parser("mail", help="the mail this device received and kept (JSON lines)")
    p.add_argument("--seed", required=True)
    p.add_argument("--state", help=state_help)
    p.set_defaults(func=cmd_ppp_mail)
    p = pp.add_parser("receive", help="fetch, unwrap, verify and print events (JSON lines)")
    p.add_argument("--seed", required=True)
    p.add_argument("--ack", action="store_true", help="acknowledge the events that opened")
    p.add_argument("--since", type=_int_in(0, 2 ** 64 - 1, "--since"), default=0,
                   help="created_at lower bound (default 0)")
    p.add_argument("--here", type=float, nargs=2, metavar=("LAT", "LON"),
                   help="add 'inside': whether this point is in each event's region")
    p.add_argument("--blinded", action="store_true",
                   help="fetch my blinded mailboxes of each --contact: every day a sender's "
                        "event may still be alive (30 days), less the days already emptied")
    p.add_argument("--contact", action="append", type=_pubkey, metavar="PUBKEY",
                   help="a contact whose blinded mailboxes to fetch (repeat)")
    p.add_argument("--http", action="store_true",
                   help="HTTP polling (§5.2: signed GET/POST) instead of the WebSocket")
    p.add_argument("--url", help=url_help)
    p.add_argument("--state", help=state_help)
    p.set_defaults(func=cmd_ppp_receive)
    _add_room_parser(pp, url_help)
    _add_courier_parsers(pp, url_help)
    p = pp.add_parser("discover-contacts",
                      help="which of my contacts use this relay (§9: peppered hashes only)")
    p.add_argument("--seed", required=True)
    p.add_argument("--contacts", help="file of phone numbers (+E.164) and e-mail addresses, "
                                      "one per line ('-': stdin)")
    p.add_argument("--publish", action="append", metavar="IDENTIFIER",
                   help="my own phone number or e-mail, published (hashed) so contacts find "
                        "me; repeat for each (a publish replaces the previous set)")
    p.add_argument("--url", help=url_help)
    p.set_defaults(func=cmd_ppp_discover_contacts)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; docs/hooks/cli_reference.py renders the CLI reference from it."""
    parser = argparse.ArgumentParser(prog="relay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conf", help="settings file (default: $RELAY_CONF or ./conf/relay.toml)")
    parser.add_argument("--data-dir", help="data directory (default: $RELAY_DATA_DIR or ./data)")
    parser.add_argument("--log-format", choices=["auto", "text", "json"],
                        help="logs on stderr: readable text, or one JSON object per line "
                             "(default: $RELAY_LOG_FORMAT or auto = text on a terminal, "
                             "else json); `relay up` passes it to every role")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                        help="least severe record logged (default: $RELAY_LOG_LEVEL or info; "
                             "debug adds tracebacks); `relay up` passes it to every role")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="run everything embedded").set_defaults(func=cmd_up)
    p = sub.add_parser("ingress", help="protocol listeners -> landing")
    p.add_argument("--protocol", choices=config.INGRESS_PROTOCOLS,
                   help="run this protocol's listener only, as node <node_id>-<protocol> "
                        "(default: every enabled listener in this process)")
    p.set_defaults(func=cmd_ingress)
    sub.add_parser("egress", help="inbox -> clients").set_defaults(func=cmd_egress)
    p = sub.add_parser("push", help="inbox -> push wake-ups of offline devices (APNs, FCM, "
                                    "Web Push)")
    p.add_argument("--vapid-public-key", action="store_true",
                   help="print the relay's VAPID public key (base64url; created if missing) "
                        "for web apps' applicationServerKey, and exit")
    p.set_defaults(func=cmd_push)
    p = sub.add_parser("stream", help="landing -> inbox (Spark)")
    p.add_argument("--available-now", action="store_true",
                   help="process what has landed, then exit")
    p.add_argument("--master", help="Spark master URL, e.g. spark://host:7077 (a cluster from "
                                    "`relay spark`) or local[N] (default: stream.master)")
    p.set_defaults(func=cmd_stream)
    spark = sub.add_parser("spark", help="a Spark standalone cluster for the stream, from the "
                                         "installed pyspark (authenticated by "
                                         "<data>/keys/spark_secret)").add_subparsers(
        dest="spark_command", required=True)
    p = spark.add_parser("master", help="run a master (then workers, then `relay stream "
                                        "--master spark://HOST:PORT`)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7077)
    p.add_argument("--webui-port", type=int, default=8080)
    p.set_defaults(func=cmd_spark_master)
    p = spark.add_parser("worker", help="run a worker of a master")
    p.add_argument("master", help="spark://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    p.add_argument("--memory", default="2g", help="memory for executors (default 2g)")
    p.add_argument("--webui-port", type=int, default=8081)
    p.add_argument("--work-dir", help="executors' working directories (default "
                                      "<data>/spark-work)")
    p.set_defaults(func=cmd_spark_worker)
    p = sub.add_parser("compact", help="purge, compact, checkpoint, vacuum")
    p.add_argument("--loop", action="store_true", help="repeat every compaction.interval_seconds")
    p.add_argument("--json", action="store_true",
                   help="one run; its report as one JSON line on stdout (what --loop runs)")
    p.set_defaults(func=cmd_compact)
    sub.add_parser("keys", help="print the relay public keys").set_defaults(func=cmd_keys)
    heya = sub.add_parser("heya", help="Heya operator tools").add_subparsers(
        dest="heya_command", required=True)
    p = heya.add_parser("inbox-token", help="mint inbox tokens (single use, for INCO)")
    p.add_argument("--count", type=int, default=1, help="how many (default 1)")
    p.set_defaults(func=cmd_heya_inbox_token)
    p = sub.add_parser("status", help="tables, landing lag and each process's /metrics")
    p.add_argument("--json", action="store_true", help="machine-readable")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("loadgen", help="fill the data directory with a synthetic day")
    p.add_argument("--day", help="UTC day YYYY-MM-DD (default: the 24 h up to this hour)")
    p.add_argument("--hours", type=float, default=24.0, help="length of the day (default 24)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="1.0 = about 20,000 pushes to 2,000 mailboxes")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--compact", action="store_true", help="run compaction at the end")
    p.add_argument("--retain", action="store_true",
                   help="compact, let compaction.vacuum_retention_seconds pass, compact again "
                        "and report the storage ratio (tables / (live ciphertext + the inbox "
                        "rows' metadata)) before and after")
    p.add_argument("--results", default=None, metavar="FILE",
                   help="with --retain: write the storage figures before and after as JSON "
                        "(the capacity notebook plots them)")
    p.set_defaults(func=cmd_loadgen)
    p = sub.add_parser("bench", help="benchmarks -> JSON")
    p.add_argument("--quick", action="store_true", help="small sizes: about 6 minutes for 3 rounds, 2-3 for --rounds 1")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of every section; each figure is their median (default 3)")
    p.add_argument("--out", default=None,
                   help="results file (default bench-results.json; bench-peer.json with --peer, "
                        "bench-peer-nostr-rs-relay.json with --peer nostr-rs-relay, "
                        "bench-startup.json with --startup, bench-object-store.json with "
                        "--object-store, bench-sync-transports.json with --sync-transports)")
    p.add_argument("--peer", nargs="?", const="nostr-relay", default=None,
                   choices=("nostr-relay", "nostr-rs-relay"),
                   help="our PPP against a public Nostr relay, alternating runs: nostr-relay "
                        "(Python, the default; installed into .venv-peer on first use) or "
                        "nostr-rs-relay (Rust; built once with cargo into "
                        "~/.cache/spark-relay/peers)")
    p.add_argument("--build-only", action="store_true",
                   help="with --peer: install or build the peer, then stop; with "
                        "--sync-transports: build the Rust iroh load client, then stop")
    p.add_argument("--trueseal-netns", action="store_true",
                   help="trueseal one NK connection per push, the clients on loopback and in "
                        "a network namespace of their own (veth; root), the relay's CPU per "
                        "connection with the written-out and the package's NK responder "
                        "-> bench-trueseal-netns.json")
    p.add_argument("--hosts", action="store_true",
                   help="push on one host, Deliver on another (ingress and egress on their "
                        "own data directories, the peer channel between them) against both "
                        "on one host, alternating, and a PPP STORE to a recipient on "
                        "another host's PPP listener against the same one: p50/p90/p99 "
                        "and their ratios -> bench-hosts.json")
    p.add_argument("--startup", action="store_true",
                   help="`relay up` from cold, each round: seconds to the first PPP ack and to "
                        "ready, then idle CPU and memory -> bench-startup.json")
    p.add_argument("--object-store", action="store_true",
                   help="landing commit latency and stream throughput with the tables on "
                        "local disk and on an S3 server (moto, loopback), alternating "
                        "-> bench-object-store.json")
    p.add_argument("--sync-transports", action="store_true",
                   help="cursor-sync over aioquic and over iroh, alternating: requests "
                        "without the stream, PUSH_ACKs with it, the iroh bindings' cost per "
                        "call and per request -> bench-sync-transports.json")
    p.add_argument("--state", action="store_true",
                   help="the stream's state store at 1 M and 5 M live event ids (--quick: "
                        "0.2 M and 1 M): memory of the stream's process tree and the time "
                        "from a restart to its first batch -> bench-state.json")
    p.add_argument("--control-hosts", action="store_true",
                   help="a Heya control change on one host, on two hosts in turn (each "
                        "change loses to the other's and is decided again) and a token "
                        "looked up on the host that did not make it; a PPP quota hit likewise "
                        "-> bench-control-hosts.json")
    p.set_defaults(func=cmd_bench)
    _add_ppp_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if argv is None:
        _with_listener_allocator(args.command)
    if args.log_format:
        os.environ["RELAY_LOG_FORMAT"] = args.log_format   # children of `relay up` inherit it
    if args.log_level:
        os.environ["RELAY_LOG_LEVEL"] = args.log_level     # likewise
    try:
        _explained(args.func, args)
    except BrokenPipeError:
        # `relay keys | head -1`: the reader left. What is left to print has nowhere to go:
        # no traceback, and none either when Python flushes stdout at exit (its docs' recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


def _explained(func, args) -> None:
    """Run the command; a failure an operator can fix (a bad setting, the object store's
    credentials or bucket, a port in use, a full disk, a certificate) ends it with one line
    and exit status 2 for configuration (runtime/operator_errors.py), not a traceback."""
    from runtime import operator_errors
    try:
        func(args)
    except (SystemExit, KeyboardInterrupt, BrokenPipeError):
        raise
    except Exception as exc:
        store = ""
        try:
            store = config.load(args.conf, env=None).tables_dir
        except Exception:
            pass
        failure = operator_errors.explain(exc, store)
        if failure is None:
            raise
        if logs.active() is None:
            logs.setup(args.command)
        operator_errors.report(failure, exc)
        sys.exit(failure.exit_code)


if __name__ == "__main__":
    main()
