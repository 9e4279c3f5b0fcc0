"""An egress node: the inbox tail, the pending hub, the ack writer and the receive listeners."""

from __future__ import annotations

import asyncio
import logging

from delta_tables.group_commit import DeltaAppendTarget, GroupCommitAppender
from delta_tables.layout import Layout
from delta_tables.schema import ACKS
from runtime import keys, metrics, open_files
from runtime.config import Settings
from runtime.handoff import Handoff, HandoffReceiver, handoff_dir
from runtime.role import run_role

from .inbox_tail import AckWriter, InboxTail
from .pending import MailboxHub
from .trueseal_receive import ReceiveServer

log = logging.getLogger("relay.egress")


class EgressNode:
    def __init__(self, settings: Settings, *, fsync: bool = True):
        self.settings = settings
        self.layout = Layout.of(settings)
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
        self.handoff: HandoffReceiver | None = None
        self.peers = None
        if settings.cluster.peer_dial and settings.trueseal.early_delivery:
            # pushes landed on other hosts' ingress, handed over at once (runtime/peer_link.py)
            from delta_tables.peer_registry import PeerStore
            from runtime.peer_link import PeerDialer, peer_key
            self.peers = PeerDialer(settings, peer_key(settings.data_dir),
                                    PeerStore(self.layout.tables),
                                    f"{settings.ingress.node_id}-egress", self._early,
                                    self.hub.mailboxes_online)
            self.hub.watch = self.peers.watch

    async def start(self) -> None:
        await self.acks.start()
        await self.tail.bootstrap()
        self._tail_task = asyncio.create_task(
            self.tail.follow(self.settings, self._stop, "egress"))
        if self.settings.trueseal.early_delivery:
            self.handoff = await HandoffReceiver.open(handoff_dir(self.settings.data_dir),
                                                      "egress", self._early)
        if self.peers is not None:
            await self.peers.start()
        await self.trueseal.start()

    def _early(self, h: Handoff) -> None:
        """A push ingress just landed: delivered now if its receiver is online here."""
        if h.protocol == "trueseal":
            self.hub.add_early(h.protocol, h.mailbox, h.event_id, h.envelope, h.expires_at)

    def listeners(self) -> list:
        return [self.trueseal]

    def listening(self) -> dict[str, str]:
        return {"trueseal_receive": f"{self.settings.bind}:{self.trueseal.bound_port}"}

    async def close(self) -> None:
        if self.handoff is not None:
            self.handoff.close()
        if self.peers is not None:
            await self.peers.close()
        await self.trueseal.close()
        await self._rows_of_early_acks()
        self._stop.set()
        if self._tail_task:
            await self._tail_task
        await self.hub.drain()
        await self.acks.close()

    async def _rows_of_early_acks(self, limit_seconds: float = 3.0) -> None:
        """Acks of early envelopes wait for their inbox rows: give a running stream a moment
        to commit them, so that they are written now rather than redelivered after the
        restart (which is still what happens past the limit)."""
        deadline = asyncio.get_running_loop().time() + limit_seconds
        while self.hub.early_acks_waiting:
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.05)


async def run(settings: Settings, stop: asyncio.Event, ready=None) -> None:
    open_files.raise_limit()   # before any socket: the listener's caps need the descriptors
    node = EgressNode(settings)
    await run_role(settings, "egress", node, metrics.egress_registry(node), stop, ready)
    log.info("egress stopped", extra={"event": "egress_stopped",
                                      "delivered": node.hub.delivered, "acked": node.hub.acked})
