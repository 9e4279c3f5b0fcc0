"""The Rust load client of cursor-sync's iroh endpoint (`relay/bench/iroh_client/`), for
`relay bench --sync-transports`.

Python clients on the iroh bindings pay the same per-call cost the relay pays (every stream
operation is a Rust future completed through a wake-up of the asyncio loop), and on 2 cores
they compete with the relay for the same CPU: the load would measure itself. This client
speaks what a stock 0k-sync client does (its source says how) on the iroh crate directly.
It is a benchmark peer: crates.io serves benchmark peers only, never the relay's own path.

Built once with cargo from the crate in this repository (its Cargo.lock pins every
dependency) into `~/.cache/spark-relay/peers/sync-iroh-bench/` (or under
`$SPARK_RELAY_CACHE`): `relay bench --sync-transports --build-only` is that set-up step
(~15-25 minutes on 2 cores: iroh's dependency tree is large). Without the binary the bench
uses the Python clients and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from . import harness

NAME = "sync-iroh-bench"
SOURCE = Path(__file__).resolve().parent / "iroh_client"


def cache_root() -> Path:
    base = os.environ.get("SPARK_RELAY_CACHE") or Path.home() / ".cache" / "spark-relay"
    return Path(base) / "peers" / NAME


def binary() -> Path:
    return cache_root() / "target" / "release" / NAME


def available() -> bool:
    return binary().exists()


def build(say) -> Path:
    """The client, built on first use; later calls return it at once."""
    exe = binary()
    if exe.exists():
        return exe
    cargo = harness.cargo("the iroh bench client")
    say(f"building {NAME} with cargo into {cache_root()} (once; slow) ...")
    subprocess.run([cargo, "build", "--release", "--locked", "--manifest-path",
                    str(SOURCE / "Cargo.toml"), "--target-dir", str(cache_root() / "target")],
                   check=True)
    return exe


def push_worker(queue, go, where: str, seed: int, devices: int, window: int, warmup: float,
                seconds: float, body_size: int, pull: bool = False) -> None:
    """`relay/bench/sync.py`'s `push_worker` contract (a spawned process: "ready", then the
    result dict on `queue`), the load made by the Rust client."""
    try:
        proc = subprocess.Popen(
            [str(binary()), where, str(devices), str(window), str(warmup), str(seconds),
             str(body_size), "pull" if pull else "push", str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(proc.stderr.read()[-500:])
        queue.put({"ready": True})
        go.wait()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = json.loads(proc.stdout.readline())
        proc.wait(30)
        queue.put(out)
    except Exception as exc:
        queue.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
