"""An ingress node: listeners for every protocol over one group-committed landing table.

The Heya listener lives here too (when `heya.enabled`): a Heya connection both sends (SEND ->
landing, through the same appender) and receives (HAVE / WANT read the inbox), and its
control tables are owned by this process (ingress/heya.py)."""

from __future__ import annotations

import asyncio
import logging

from delta_tables.group_commit import GroupCommitAppender, LandingTarget
from delta_tables.layout import Layout
from runtime import keys, metrics, open_files
from runtime.config import Settings
from runtime.role import run_role

from .heya import HeyaServer
from .sync_quic import SyncServer
from .ppp_app import PppServer
from .trueseal_push import PushServer

log = logging.getLogger("relay.ingress")


class IngressNode:
    def __init__(self, settings: Settings, *, fsync: bool = True):
        self.settings = settings
        self.layout = Layout(settings.data_dir)
        conf = settings.ingress
        self.target = LandingTarget(self.layout, conf.node_id,
                                    commits_per_generation=conf.commits_per_generation,
                                    refresh_every=conf.refresh_handle_every, fsync=fsync)
        self.appender = GroupCommitAppender(self.target, max_rows=conf.max_rows_per_commit)
        self.key = keys.load_or_create(settings.data_dir)
        self.trueseal = PushServer(settings, self.appender, self.key)
        self.heya = (HeyaServer(settings, self.appender, fsync=fsync)
                     if settings.heya.enabled else None)
        self.sync = (SyncServer(settings, self.appender, fsync=fsync)
                     if settings.sync.enabled else None)
        self.ppp = (PppServer(settings, self.appender, fsync=fsync)
                    if settings.ppp.enabled else None)

    async def start(self) -> None:
        await self.appender.start()
        await self.trueseal.start()
        if self.heya is not None:
            await self.heya.start()
        if self.sync is not None:
            await self.sync.start()
        if self.ppp is not None:
            await self.ppp.start()

    def listeners(self) -> list:
        return [srv for srv in (self.trueseal, self.heya, self.sync, self.ppp) if srv is not None]

    def listening(self) -> dict[str, str]:
        out = {"trueseal_push": f"{self.settings.bind}:{self.trueseal.bound_port}"}
        if self.heya is not None:
            out["heya"] = f"{self.settings.bind}:{self.heya.bound_port}"
        if self.sync is not None:
            out["sync"] = f"{self.settings.bind}:{self.sync.bound_port}"
        if self.ppp is not None:
            out["ppp"] = f"{self.settings.bind}:{self.ppp.bound_port}"
        return out

    async def close(self) -> None:
        """Stop accepting; pushes already being stored finish (and are acked) first."""
        await self.trueseal.close()
        if self.heya is not None:
            await self.heya.close()
        if self.sync is not None:
            await self.sync.close()
        if self.ppp is not None:
            await self.ppp.close()
        await self.appender.close()


async def run(settings: Settings, stop: asyncio.Event, ready=None) -> None:
    open_files.raise_limit()   # before any socket: the listeners' caps need the descriptors
    node = IngressNode(settings)
    await run_role(settings, "ingress", node, metrics.ingress_registry(node), stop, ready)
    log.info("ingress stopped", extra={"event": "ingress_stopped",
                                       "rows": node.appender.rows_committed})
