"""nostr-rs-relay, the compiled Nostr relay, as a peer of `relay bench --peer nostr-rs-relay`.

nostr-rs-relay (Rust, tokio, SQLite) is the relay operators pick when they want a fast one.
It is built once from crates.io with cargo, at the version pinned here, into a cache outside
the repository (`~/.cache/spark-relay/peers/nostr-rs-relay-<version>/bin/nostr-rs-relay`,
or under `$SPARK_RELAY_CACHE`); none of its source is kept here. Its build needs `protoc`
(its gRPC extension point): Debian's `protobuf-compiler` is installed with apt-get when it is
missing and we are root. `relay bench --peer nostr-rs-relay --build-only` does this step
alone, so a set-up can build ahead of a bench.

It runs with the config.toml it ships (every setting commented out, so its compiled-in
defaults: SQLite, 4-8 pooled connections, no rate limit, 128 KiB events), with three lines
changed: it listens on loopback on a free port, and its database is in the round's
temporary directory. Its log goes to a file at WARNING (`RUST_LOG=warn`), as the other
peer's does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

VERSION = "0.8.12"          # crates.io; the newest release when this bench was written
NAME = "nostr-rs-relay"

# What it has written to disk when it answers OK (read in its source at this version):
# src/db.rs sends `Notice::saved` (the OK) after `repo.write_event` returns, and
# src/repo/sqlite.rs `write_event` commits the insert's transaction before it returns; the
# database is opened with src/repo/sqlite_migration.rs's startup pragmas
# `journal_mode = WAL` and `synchronous = NORMAL`.
DURABILITY = (
    "OK after the event's SQLite transaction commits (src/db.rs: Notice::saved after "
    "write_event; src/repo/sqlite.rs), in WAL mode with synchronous=NORMAL "
    "(src/repo/sqlite_migration.rs): the commit is written to the WAL file but not fsynced; "
    "SQLite fsyncs the WAL only at a checkpoint. An acked event survives a kill of the "
    "process (the page cache holds it), not a power loss or kernel crash before the next "
    "checkpoint.")


def cache_root() -> Path:
    base = os.environ.get("SPARK_RELAY_CACHE") or Path.home() / ".cache" / "spark-relay"
    return Path(base) / "peers" / f"{NAME}-{VERSION}"


def binary() -> Path:
    return cache_root() / "bin" / NAME


def _protoc(say) -> None:
    if shutil.which("protoc"):
        return
    if os.geteuid() != 0:
        raise RuntimeError("building nostr-rs-relay needs protoc: install Debian's "
                           "protobuf-compiler (apt-get install protobuf-compiler)")
    say("installing protobuf-compiler (protoc) with apt-get ...")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if subprocess.run(["apt-get", "install", "-y", "-q", "protobuf-compiler"],
                      env=env).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, check=True)
        subprocess.run(["apt-get", "install", "-y", "-q", "protobuf-compiler"], env=env,
                       check=True)


def build(say) -> Path:
    """The pinned nostr-rs-relay, built with `cargo install --locked` on first use (about
    10-15 minutes on 2 cores); later calls return the cached binary at once."""
    exe = binary()
    if exe.exists():
        return exe
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    if not Path(cargo).exists():
        raise RuntimeError("building nostr-rs-relay needs cargo (https://rustup.rs)")
    _protoc(say)
    say(f"building {NAME} {VERSION} with cargo into {cache_root()} (once; slow) ...")
    subprocess.run([cargo, "install", NAME, "--version", VERSION, "--locked",
                    "--root", str(cache_root())], check=True)
    return exe


def config_toml(port: int, data_dir: Path) -> str:
    """Its documented config.toml with every setting at its default, but where it listens
    and where its database lives (loopback only; a temporary directory)."""
    return ("# nostr-rs-relay's shipped config.toml: every other setting at its default\n"
            "[info]\n"
            'relay_url = "ws://127.0.0.1/"\n'
            'name = "nostr-rs-relay"\n'
            "[database]\n"
            f"data_directory = {json.dumps(str(data_dir))}\n"
            "[network]\n"
            'address = "127.0.0.1"\n'
            f"port = {int(port)}\n"
            "[options]\n"
            "reject_future_seconds = 1800\n")


def start(work: Path, port: int) -> subprocess.Popen:
    """nostr-rs-relay on 127.0.0.1:`port` with its database and log in `work`."""
    data = work / "db"
    data.mkdir(parents=True, exist_ok=True)
    conf = work / "config.toml"
    conf.write_text(config_toml(port, data))
    log = open(work / f"{NAME}.log", "w")
    with contextlib.closing(log):
        return subprocess.Popen([str(binary()), "--config", str(conf), "--db", str(data)],
                                cwd=work, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, RUST_LOG="warn"),
                                start_new_session=True)
