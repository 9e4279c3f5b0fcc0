"""An ingress node: listeners for every protocol over one group-committed landing table."""

from __future__ import annotations

import asyncio
import logging

from delta_tables.group_commit import GroupCommitAppender, LandingTarget
from delta_tables.layout import Layout
from relay import keys
from relay.config import Settings
from relay.listener import serve_until

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

    async def start(self) -> None:
        await self.appender.start()
        await self.trueseal.start()

    def listening(self) -> dict[str, str]:
        return {"trueseal_push": f"{self.settings.bind}:{self.trueseal.bound_port}"}

    async def close(self) -> None:
        """Stop accepting; pushes already being stored finish (and are acked) first."""
        await self.trueseal.close()
        await self.appender.close()


async def run(settings: Settings, stop: asyncio.Event, ready=None) -> None:
    node = IngressNode(settings)
    await serve_until(node, stop, ready)
    log.info("ingress stopped", extra={"event": "ingress_stopped",
                                       "rows": node.appender.rows_committed})
