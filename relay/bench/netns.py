"""A load generator on a network host of its own: a network namespace (`ip netns`, created
and removed here; root only) joined to this one by a veth pair, and the entry point that puts
a spawned worker into it. Used by `relay bench --trueseal-netns` (trueseal_netns.py) and the
trueseal section's clients (trueseal.py)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess

CLONE_NEWNET = 0x40000000


def in_netns(netns: str | None, target, *args) -> None:
    """A spawned worker's entry: join network namespace `netns` (if any), then run
    `target(*args)`. A fresh spawned process has one thread, as setns(2) requires."""
    if netns:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(f"/var/run/netns/{netns}") as f:
            if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {netns}")
    target(*args)


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)


@contextlib.contextmanager
def other_host(name: str, net: int, addresses: int = 1):
    """A network host of its own: network namespace `<name><pid>` joined to this one by a veth
    pair on 10.`net`.N.0/24 (N from our pid, so two runs do not collide), this side .1, the
    namespace's side .2 on (`addresses` of them). Root only; removed on exit. Yields (the
    namespace, this side's address, the namespace's first address)."""
    pid = os.getpid()
    n = pid % 250 + 1
    ns, host_if, ns_if = f"{name}{pid}", f"{name[-2:]}h{pid}", f"{name[-2:]}c{pid}"
    here = f"10.{net}.{n}.1"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", ns)
        _ip("addr", "add", f"{here}/24", "dev", host_if)
        _ip("link", "set", host_if, "up")
        batch = "".join(f"addr add 10.{net}.{n}.{i + 2}/24 dev {ns_if}\n"
                        for i in range(addresses))
        subprocess.run(["ip", "-n", ns, "-batch", "-"], input=batch, text=True, check=True,
                       capture_output=True)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, here, f"10.{net}.{n}.2"
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextlib.contextmanager
def client_host():
    """The load generator's host (`other_host` on 10.231.N.0/24): its push loops connect from
    the namespace's addresses (trueseal_client.source_address). Yields (namespace name, the
    relay's address as the clients see it)."""
    from .trueseal_client import NETNS_SOURCES
    if os.geteuid() != 0:
        raise RuntimeError("--trueseal-netns creates a network namespace: run it as root")
    with other_host("relaybench", 231, NETNS_SOURCES) as (ns, relay_addr, _):
        yield ns, relay_addr
