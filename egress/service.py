"""An egress node: the inbox tail, the pending hub, the ack writer and the receive listeners."""

from __future__ import annotations

import asyncio
import logging

from delta_tables.group_commit import DeltaAppendTarget, GroupCommitAppender
from delta_tables.layout import Layout
from delta_tables.schema import ACKS
from runtime import keys, metrics, open_files
from runtime.config import Settings
from runtime.role import run_role

from .inbox_tail import AckWriter, InboxTail
from .pending import MailboxHub
from .trueseal_receive import ReceiveServer

log = logging.getLogger("relay.egress")


class EgressNode:
    def __init__(self, settings: Settings, *, fsync: bool = True):
        self.settings = settings
        self.layout = Layout(settings.data_dir)
        self.layout.ensure_shared_tables()
        conf = settings.egress
        self.acks = GroupCommitAppender(
            DeltaAppendTarget(self.layout.acks, ACKS, fsync=fsync),
            max_rows=conf.ack_max_rows_per_commit)
        self.hub = MailboxHub(AckWriter(self.acks), max_pending=conf.max_pending_per_mailbox)
        # Only trueseal is pushed from here. Heya, PPP and cursor-sync clients read by seq or
        # cursor from the ingress process that hosts their listener, which tails the inbox
        # for its own protocol (egress/{heya,ppp,sync}_inbox.py, composed in ingress/).
        self.tail = InboxTail(self.layout.inbox, self.layout.acks, self.hub,
                              protocols={"trueseal"})
        self.hub.loader = self.tail.load
        self.key = keys.load_or_create(settings.data_dir)
        self.trueseal = ReceiveServer(settings, self.hub, self.key)
        self._stop = asyncio.Event()
        self._tail_task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.acks.start()
        await self.tail.bootstrap()
        self._tail_task = asyncio.create_task(
            self.tail.follow(self.settings, self._stop, "egress"))
        await self.trueseal.start()

    def listeners(self) -> list:
        return [self.trueseal]

    def listening(self) -> dict[str, str]:
        return {"trueseal_receive": f"{self.settings.bind}:{self.trueseal.bound_port}"}

    async def close(self) -> None:
        await self.trueseal.close()
        self._stop.set()
        if self._tail_task:
            await self._tail_task
        await self.acks.close()


async def run(settings: Settings, stop: asyncio.Event, ready=None) -> None:
    open_files.raise_limit()   # before any socket: the listener's caps need the descriptors
    node = EgressNode(settings)
    await run_role(settings, "egress", node, metrics.egress_registry(node), stop, ready)
    log.info("egress stopped", extra={"event": "egress_stopped",
                                      "delivered": node.hub.delivered, "acked": node.hub.acked})
