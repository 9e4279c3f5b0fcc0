"""An ingress node id is unique by construction: it belongs to one state directory, and to one
live process of it.

Why it matters: compaction drops a landing generation once a newer generation of the same node
exists and the stream has consumed it (jobs/compact.py). Two live processes under one node id
would each start their own generation, and the first one's, still written to, could be
dropped under it: acked envelopes lost. So an ingress process claims its node id first:

* `<landing>/<node>/_owner.json`, created only if absent (a temporary file `link()`ed to the
  name, as the relay's keys are: runtime/keys.write_secret_file; with the tables on S3, an
  empty Delta table `_owner` created by a conditional PUT, its description the record), names
  the node's token, host and state directory. The token lives in the owner's
  state directory (`<data>/state/nodes/<node>.token`), so a node id taken by another host, or
  by another data directory on this host, is refused with a message naming the owner, and a
  restart of the owner is recognised;
* `<data>/state/nodes/<node>.lock`, held with `flock` for the life of the process: a second
  process of the same state directory (started twice by mistake) is refused; the kernel
  releases it when the process dies, even by SIGKILL.

A node that is gone for good is not taken over: start its replacement under a new node id (the
stream reads every node's landing, the old one's included, until compaction drops it).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
from pathlib import Path

from runtime import keys

from . import object_store

OWNER_FILE = "_owner.json"


class NodeIdTaken(RuntimeError):
    pass


class NodeClaim:
    def __init__(self, landing_root: Path, state_dir: Path, node: str):
        self.node = node
        self.remote = object_store.is_remote(landing_root)
        self.owner_file = (landing_root / node / "_owner" if self.remote
                           else Path(landing_root) / node / OWNER_FILE)
        self.state = Path(state_dir) / "nodes"
        self._lock_fd = -1

    def acquire(self) -> "NodeClaim":
        self.state.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state / f"{self.node}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise NodeIdTaken(f"ingress node {self.node!r} is already running from this data "
                              f"directory; give each ingress process its own node id "
                              f"(ingress.node_id / RELAY_NODE_ID)") from None
        self._lock_fd = fd
        try:
            self._own()
        except BaseException:
            self.release()
            raise
        return self

    def _own(self) -> None:
        token = self._token()
        me = {"token": token, "host": socket.gethostname(), "state": str(self.state.parent)}
        if self.remote:
            created = _create_once_remote(self.owner_file, json.dumps(me))
        else:
            self.owner_file.parent.mkdir(parents=True, exist_ok=True)
            created = keys.write_secret_file(self.owner_file, json.dumps(me).encode())
        if not created:
            owner = json.loads(self._read_owner())
            if owner.get("token") != token:
                raise NodeIdTaken(
                    f"ingress node id {self.node!r} belongs to the state directory "
                    f"{owner.get('state')} on host {owner.get('host')}; give this node its own "
                    f"id (ingress.node_id / RELAY_NODE_ID)")

    def _read_owner(self) -> str:
        if self.remote:
            from deltalake import DeltaTable
            return DeltaTable(str(self.owner_file)).metadata().description or "{}"
        return self.owner_file.read_text()

    def _token(self) -> str:
        path = self.state / f"{self.node}.token"
        keys.write_secret_file(path, secrets.token_hex(16).encode())
        return path.read_text().strip()

    def lock_identity(self) -> str:
        """Which lock this process holds: the kernel's boot and the lock file's inode. A
        process that holds it again (same file, same running kernel) knows the previous
        holder of that identity is gone: it would hold the lock still (node_lease.py). A copy
        of the data directory is another inode; a copied machine, another boot."""
        st = os.fstat(self._lock_fd)
        return f"{_boot_id()}:{st.st_dev}:{st.st_ino}"

    def release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)     # closing the descriptor drops the flock
            self._lock_fd = -1


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:         # not Linux: this process's start stands for the boot
        return f"pid{os.getpid()}"


def _create_once_remote(path, record: str) -> bool:
    """Create-if-absent on S3: creating version 0 of a Delta table is a conditional PUT."""
    import pyarrow as pa
    from deltalake import DeltaTable
    try:
        DeltaTable.create(str(path), schema=pa.schema([("unused", pa.int8())]), mode="error",
                          description=record)
        return True
    except Exception:
        if DeltaTable.is_deltatable(str(path)):
            return False
        raise
