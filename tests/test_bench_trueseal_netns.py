"""`relay bench --trueseal-netns`: the load generator's network host. The namespace and its
veth are made, carry a TCP connection from a spawned worker inside to a listener here, from
the worker's own address there, and are gone afterwards. (The bench itself writes a results
file; it is not run here.)"""

import multiprocessing as mp
import os
import socket
import subprocess

import pytest

from relay.bench import netns, trueseal_client

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def _connect_from(host: str, port: int, source: str, out) -> None:
    with socket.create_connection((host, port), timeout=5, source_address=(source, 0)) as c:
        out.put(c.getsockname()[0])


def test_workers_in_the_namespace_reach_the_relay_address_and_it_is_removed():
    with netns.client_host() as (ns, relay_addr):
        assert ns in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                    text=True).stdout
        with socket.socket() as srv:
            srv.bind((relay_addr, 0))
            srv.listen()
            port = srv.getsockname()[1]
            source = trueseal_client.source_address(1, 5, relay_addr)
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            p = ctx.Process(target=netns.in_netns,
                            args=(ns, _connect_from, relay_addr, port, source, out))
            p.start()
            conn, peer = srv.accept()
            conn.close()
            p.join(10)
            assert p.exitcode == 0
            assert peer[0] == source == out.get(timeout=5) != relay_addr
            # from this namespace the worker's address is not ours
            with pytest.raises(OSError):
                socket.create_connection((relay_addr, port), timeout=2,
                                         source_address=(source, 0)).close()
    assert ns not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                    text=True).stdout


def test_loopback_sources_are_unchanged():
    assert trueseal_client.source_address(1, 5) == "127.2.0.6"
