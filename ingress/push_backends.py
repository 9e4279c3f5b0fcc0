"""What each listener's push desk answers (runtime/push_desk.py): whom to wake for an inbox
row, from the listener's own sessions and its protocol's push registrations.

* PPP (spec 004): the recipient pubkey's REGISTER_PUSH tokens, when no WebSocket of that
  pubkey is attached here and the event is still unacked. Room messages wake nobody: a room
  member is known to the relay only by an anonymous member token. A knock wakes the room's
  admin the same way (`PppDesk.knock`, from the KNOCK handler: knocks are not inbox rows).
* Heya: the mailbox owner's IOSA tokens (iOS devices: platform `apns`), when no session of
  that owner is connected and the message is not trimmed.
* cursor-sync: each device of the group with a RegisterPush token, except the device that
  pushed the blob, that has no live session and has not acked past the blob's cursor.

`last_seen` tells the push job whether a device came back after its last wake-up
(engine/push/coalesce.py).
"""

from __future__ import annotations

from runtime.push_desk import Device

MAX_KNOCK_WAKES = 10_000    # admins waiting for the push job's next poll (it polls each second)


class PppDesk:
    def __init__(self, inbox, control):
        """`inbox`: the PppInbox (sessions, pending events); `control`: the PppControl."""
        self.inbox = inbox
        self.control = control
        self.knocked: dict[bytes, None] = {}   # admins to wake (knocks), in order

    def _devices(self, pubkey: bytes) -> list[Device]:
        seen = self.inbox.sessions.last_seen.get(pubkey)
        return [Device(pubkey, platform, token, seen)
                for platform, token in self.control.push_tokens(pubkey)]

    def wake(self, mailbox: bytes, cursor: int, meta: bytes | None) -> list[Device]:
        if mailbox in self.inbox.sessions or not self.inbox.owed(mailbox, cursor):
            return []
        return self._devices(mailbox)

    def owner(self, owner: bytes) -> tuple[bool, list[Device]]:
        return owner in self.inbox.sessions, self._devices(owner)

    async def drop(self, owner: bytes, platform: str, token: bytes) -> bool:
        return await self.control.deregister_push(owner, platform, token)

    def knock(self, admin: bytes) -> None:
        """A KNOCK for a room whose admin has no WebSocket here. Knocks are not inbox rows
        (they live 120 s in this process's memory), so the push job asks for these."""
        if len(self.knocked) < MAX_KNOCK_WAKES:
            self.knocked[admin] = None

    def pending(self) -> list[Device]:
        """Devices of knocked-at admins who are still offline; the list is emptied."""
        admins, self.knocked = list(self.knocked), {}
        return [d for a in admins if a not in self.inbox.sessions for d in self._devices(a)]


class _NoPending:
    def pending(self) -> list[Device]:
        return []


class HeyaDesk(_NoPending):
    def __init__(self, inbox, control):
        self.inbox = inbox
        self.control = control

    def _devices(self, owner: bytes) -> list[Device]:
        seen = self.inbox.sessions.last_seen.get(owner)
        return [Device(owner, "apns", device.encode("ascii"), seen)
                for device, _ in self.control.push_tokens(owner)]

    def wake(self, mailbox: bytes, cursor: int, meta: bytes | None) -> list[Device]:
        owner = self.control.owner_of(mailbox)     # a Heya mailbox row is keyed by send token
        if owner is None or self.inbox.sessions_of(owner) or cursor <= self.control.trimmed(
                mailbox):
            return []
        return self._devices(owner)

    def owner(self, owner: bytes) -> tuple[bool, list[Device]]:
        return bool(self.inbox.sessions_of(owner)), self._devices(owner)

    async def drop(self, owner: bytes, platform: str, token: bytes) -> bool:
        return await self.control.iosd(owner, token.decode("ascii"))


class SyncDesk(_NoPending):
    def __init__(self, server, decode_meta):
        """`server`: the SyncServer (sessions, `last_seen`, control); `decode_meta`:
        egress.sync_inbox.decode_meta (the sender device of a row)."""
        self.server = server
        self.decode_meta = decode_meta

    def _devices(self, group: bytes, device: bytes) -> list[Device]:
        state = self.server.control.state
        seen = self.server.last_seen.get((group, device))
        return [Device(group + device, platform, token, None if seen is None else float(seen))
                for platform, token in sorted(state.push.get((group, device), ()))]

    def wake(self, mailbox: bytes, cursor: int, meta: bytes | None) -> list[Device]:
        state = self.server.control.state
        sender = None
        if meta:
            try:
                sender = self.decode_meta(meta)[1]
            except Exception:
                sender = None
        out: list[Device] = []
        for device in sorted(state.members.get(mailbox, ())):   # the group's few devices
            if ((mailbox, device) not in state.push or device == sender
                    or self.server.online(mailbox, device)
                    or state.acked_cursor(mailbox, device) >= cursor):
                continue
            out.extend(self._devices(mailbox, device))
        return out

    def owner(self, owner: bytes) -> tuple[bool, list[Device]]:
        group, device = owner[:32], owner[32:]
        return self.server.online(group, device), self._devices(group, device)

    async def drop(self, owner: bytes, platform: str, token: bytes) -> bool:
        group, device = owner[:32], owner[32:]
        if (platform, token) not in self.server.control.state.push.get((group, device), ()):
            return False
        await self.server.control.push_registration(group, device, platform, token, False)
        return True
