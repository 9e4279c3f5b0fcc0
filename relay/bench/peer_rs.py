"""nostr-rs-relay, the compiled Nostr relay, as a peer of `relay bench --peer nostr-rs-relay`.

nostr-rs-relay (Rust, tokio, SQLite) is the relay operators pick when they want a fast one.
It is built once from its crates.io source with cargo, at the version pinned here, into a
cache outside the repository (`~/.cache/spark-relay/peers/nostr-rs-relay-<version>/`: the
unpacked crate in `src/`, cargo's output in `target/`, the binary in `bin/`; or under
`$SPARK_RELAY_CACHE`); none of its source is kept here. Its build needs `protoc`
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
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import urllib.request
from pathlib import Path

from . import harness

VERSION = "0.8.12"          # crates.io; the newest release when this bench was written
CRATE_SHA256 = "79642781fa96050951c1821e047fb97ab98158a4ee2cd759f587f834dd84ec86"  # its index
TIME_FIX = "0.3.36"         # the `time` its Cargo.lock is built with (see build())
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


def _crate_source(say) -> Path:
    """The pinned crate's source, unpacked in the cache: from cargo's download cache when it
    has the .crate, else from crates.io; its SHA-256 checked against the registry's."""
    src = cache_root() / "src" / f"{NAME}-{VERSION}"
    if (src / "Cargo.toml").exists():
        return src
    cached = list((Path.home() / ".cargo" / "registry" / "cache").glob(
        f"*/{NAME}-{VERSION}.crate"))
    if cached:
        data = cached[0].read_bytes()
    else:
        url = f"https://static.crates.io/crates/{NAME}/{NAME}-{VERSION}.crate"
        say(f"downloading {url} ...")
        with urllib.request.urlopen(url, timeout=120) as r:
            data = r.read()
    if hashlib.sha256(data).hexdigest() != CRATE_SHA256:
        raise RuntimeError(f"{NAME}-{VERSION}.crate does not match the registry's checksum")
    src.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(src.parent, filter="data")
    return src


def build(say) -> Path:
    """The pinned nostr-rs-relay, built on first use (10-40 minutes on 2 cores); later calls
    return the cached binary at once. Built from the crate's source with its own Cargo.lock
    (`--locked`), one pin changed: `time` 0.3.25 no longer compiles with Rust 1.80 and later
    (a type inference change; fixed upstream in 0.3.35), so the lock takes 0.3.36, which
    brings serde 1.0.193. `cargo install --locked` would stop at that error."""
    exe = binary()
    if exe.exists():
        return exe
    cargo = harness.cargo("nostr-rs-relay")
    _protoc(say)
    src = _crate_source(say)
    say(f"building {NAME} {VERSION} with cargo into {cache_root()} (once; slow) ...")
    subprocess.run([cargo, "update", "-p", "time@0.3.25", "--precise", TIME_FIX], cwd=src,
                   check=False, capture_output=True)   # a no-op once done
    subprocess.run([cargo, "build", "--release", "--locked", "--target-dir",
                    str(cache_root() / "target")], cwd=src, check=True)
    exe.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(cache_root() / "target" / "release" / NAME, exe)
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
