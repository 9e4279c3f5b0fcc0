"""`relay` command line: one subcommand per process role, plus operator tools.

    relay up          everything on one machine (ingress, egress, stream, compaction)
    relay ingress     protocol listeners -> landing table of this node
    relay egress      inbox tail -> connected clients, acks
    relay stream      Spark Structured Streaming: landing -> inbox
    relay compact     purge delivered / expired envelopes, compact, checkpoint, vacuum
    relay keys        print the relay's public keys
    relay bench       measure throughput and latency, write a JSON results file
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading

from . import config, logs


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


def _run_async(main) -> None:
    async def runner():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)
    asyncio.run(runner())


def cmd_ingress(args) -> None:
    from ingress import service
    settings = _settings(args)
    logs.setup("ingress")
    _run_async(lambda stop: service.run(settings, stop, _ready("ingress")))


def cmd_egress(args) -> None:
    from egress import service
    settings = _settings(args)
    logs.setup("egress")
    _run_async(lambda stop: service.run(settings, stop, _ready("egress")))


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def cmd_stream(args) -> None:
    from jobs import stream_main
    settings = _settings(args)
    logs.setup("stream")
    stop = _stop_on_signals()
    stream_main.run(settings, stop, available_now=args.available_now,
                    ready=_ready("stream"))


def cmd_compact(args) -> None:
    from jobs import compact
    settings = _settings(args)
    logs.setup("compact")
    if args.loop:
        stop = _stop_on_signals()
        _ready("compact")({})
        compact.compaction_loop(settings, stop, progress=lambda m: print(m, flush=True))
        return
    report = compact.run_compaction(settings, progress=lambda m: print(m, flush=True))
    print(report.format())


def cmd_keys(args) -> None:
    from . import keys
    settings = _settings(args)
    key = keys.load_or_create(settings.data_dir)
    print(f"trueseal {key.public_hex}")


def cmd_up(args) -> None:
    from . import up
    settings = _settings(args)
    sys.exit(up.run(settings, args.conf))


def cmd_bench(args) -> None:
    from . import bench
    sys.exit(bench.main(args))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="relay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conf", help="settings file (default: $RELAY_CONF or ./conf/relay.toml)")
    parser.add_argument("--data-dir", help="data directory (default: $RELAY_DATA_DIR or ./data)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="run everything embedded").set_defaults(func=cmd_up)
    sub.add_parser("ingress", help="protocol listeners -> landing").set_defaults(func=cmd_ingress)
    sub.add_parser("egress", help="inbox -> clients").set_defaults(func=cmd_egress)
    p = sub.add_parser("stream", help="landing -> inbox (Spark)")
    p.add_argument("--available-now", action="store_true",
                   help="process what has landed, then exit")
    p.set_defaults(func=cmd_stream)
    p = sub.add_parser("compact", help="purge, compact, checkpoint, vacuum")
    p.add_argument("--loop", action="store_true", help="repeat every compaction.interval_seconds")
    p.set_defaults(func=cmd_compact)
    sub.add_parser("keys", help="print the relay public keys").set_defaults(func=cmd_keys)
    p = sub.add_parser("bench", help="benchmarks -> JSON")
    p.add_argument("--quick", action="store_true", help="small sizes, about three minutes")
    p.add_argument("--out", default="bench-results.json")
    p.set_defaults(func=cmd_bench)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
