"""Ingress processes as hosts (decision 0009): `relay ingress --protocol P` run as a child
process with its own data directory and node id, every host's tables in one shared directory,
listeners and metrics on ephemeral ports. What the multi-host end-to-end tests start."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT = 90.0


class Host:
    def __init__(self, root: Path, name: str, protocol: str, extra_env: dict | None = None):
        self.name, self.protocol = name, protocol
        self.data = root / f"host-{name}"
        self.tables = root / "tables"
        self.stderr = root / f"host-{name}.{protocol}.stderr.log"
        self.env = dict(os.environ, RELAY_DATA_DIR=str(self.data),
                        RELAY_TABLES_DIR=str(self.tables), RELAY_NODE_ID=f"node-{name}",
                        **{f"RELAY_{protocol.upper()}_PORT": "0",
                           f"RELAY_METRICS_PORT_INGRESS_{protocol.upper()}": "0",
                           "RELAY_METRICS_PORT_INGRESS": "0"}, **(extra_env or {}))
        self.proc: asyncio.subprocess.Process | None = None
        self.listening: dict[str, str] = {}

    def port(self, listener: str | None = None) -> int:
        return int(self.listening[listener or self.protocol].rsplit(":", 1)[1])

    async def start(self) -> "Host":
        with open(self.stderr, "a") as err:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "relay.cli", "ingress", "--protocol", self.protocol,
                cwd=REPO, env=self.env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=err)
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), READY_TIMEOUT)
            assert line, f"host {self.name} ended before ready: {self.stderr.read_text()[-2000:]}"
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and "ready" in msg:
                self.listening = msg["listening"]
                return self

    async def stop(self) -> int:
        if self.proc is None or self.proc.returncode is not None:
            return 0 if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(self.proc.wait(), 60)
        return code
