"""cursor-sync requests, whatever carries them: one class of handlers shared by the QUIC
listener (aioquic, `ingress/sync_quic.py`) and the iroh endpoint (`ingress/sync_iroh.py`).

A request arrives as one frame body on a client-opened bidirectional stream; `_handle` decodes
it, asks the session's state table (`engine/sync/session.py`) which handler may take it, applies
the rate limits, and runs `_on_<handler>`. The handlers decide everything protocol-side (limits,
membership, cursors from the inbox view, the landing append) against the listener's shared
state (`SyncServer`: inbox view, control tables, appender, limiters), so a group's devices see
one another's blobs and NOTIFYs whichever transport each came by.

A transport supplies, per connection: `_respond(stream, msg | None)` (one frame and FIN, or
the empty FIN of a refusal), `send_uni(msg)` (a relay-opened unidirectional stream),
`close(code, reason)`, and `_hello_accepted()` (widen the connection's stream limits, stop its
HELLO timer). `stream` is whatever names a request stream to the transport (a QUIC stream id
for aioquic, a bidirectional stream object for iroh). No handler logs an id, a key, a group
id, a payload or an address.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from datetime import datetime, timedelta, timezone

from delta_tables.schema import C
from egress.sync_inbox import encode_meta
from engine.admission import Stage
from engine.sync import PROTOCOL, identity, limits
from engine.sync import envelope as spec
from engine.sync import messages as m
from engine.sync.session import (CLOSE_AUTH_FAILED, CLOSE_DEVICE_REVOKED,
                                 CLOSE_TOO_MANY_SESSIONS, CONTROL_LIMITED, RATE_LIMITED, Code,
                                 Refused, Session, State)

log = logging.getLogger("relay.ingress.sync")

# Room a PULL_RESPONSE needs around one blob beyond the PUSH that carried it (tag, cursor,
# timestamp, has_more, max_cursor): a PUSH closer than this to the frame cap could never be
# pulled, so it is refused as too large (0k-sync accepts it and cannot deliver it).
PULL_HEADROOM = 64


def event_id(group: bytes, blob_id: bytes) -> bytes:
    """The dedup key: a re-push of a blob id into its group is the same event."""
    return hashlib.blake2b(group + blob_id, digest_size=32, person=b"0ksync.evt.v1").digest()


def unix_now() -> int:
    return int(time.time())


class SyncRequests:
    """One connection's requests. A subclass sets `server`, `conf`, `session`, `tasks`,
    `closed`, `draining`, `registered`, `ticket` and has the transport's four methods
    (`_respond`, `send_uni`, `close`, `_hello_accepted`: the module's docstring)."""

    server: "object"
    session: Session
    ticket = None
    handling = False          # a request is being answered (_delivering)
    spec_request = False      # the request being handled came as the spec's Envelope
    notified = 0              # spec-form sessions: the last cursor told by NOTIFY

    @property
    def device_id(self) -> bytes | None:
        return self.session.device_id

    # --- the request path ----------------------------------------------------------------------
    async def _work(self) -> None:
        """Requests in order of arrival (0k-sync handles a connection's streams in turn); a
        PUSH completes on its own task (`_store`). `requests` holds (stream, body | None)."""
        try:
            while not self.closed:
                sid, body = await self.requests.get()
                self.server.touch(self.ticket)   # a request; QUIC PINGs never come here
                self.handling = True
                try:
                    await self._handle(sid, body)
                finally:
                    self.handling = False
        except asyncio.CancelledError:
            pass
        except Exception:
            if (dropped := self.server.quiet.allow("task_failed")) is not None:
                log.exception("sync connection failed", extra={"event": "sync_task_failed",
                                                               "suppressed": dropped})
            self.close(0, "internal error")

    def _delivering(self) -> bool:
        """Mid-delivery, not to be evicted: a request being answered or waiting its turn, or
        a PUSH being stored (its PUSH_ACK owed)."""
        return self.handling or bool(self.tasks) or not self.requests.empty()

    def _hello_timeout(self) -> None:
        """F-006: no accepted HELLO in time: closed, code 3."""
        if self.session.state is not State.ACTIVE and not self.closed:
            srv = self.server
            srv.rejected["hello_timeout"] += 1
            if (dropped := srv.quiet.allow("hello_timeout")) is not None:
                log.info("hello timeout", extra={"event": "sync_hello_timeout",
                                                 "suppressed": dropped})
            self.close(CLOSE_AUTH_FAILED, "hello timeout")

    async def _handle(self, sid: int, body: bytes | None) -> None:
        if body is None:                  # oversize / truncated / timed out: empty FIN
            self._respond(sid, None)
            return
        try:
            msg, self.spec_request = decode_request(body)
        except m.DecodeError:
            self.server.rejected["malformed"] += 1
            self._respond(sid, None)
            return
        try:
            if self.draining:
                raise Refused(Code.RELAY_SHUTTING_DOWN, "relay shutting down")
            handler = self.session.route(msg)
            if isinstance(msg, RATE_LIMITED):
                self._rate_limit()
            elif isinstance(msg, CONTROL_LIMITED) and not self.server.control_limit.take(
                    self.device_id, time.monotonic()):
                raise Refused(Code.RATE_LIMITED, "rate limited")
            await getattr(self, f"_on_{handler}")(sid, msg)
        except Refused as exc:
            self._refuse(sid, msg, exc)

    def _rate_limit(self) -> None:
        now = time.monotonic()
        # 0k-sync order: the global limiter, then the device's.
        if not self.server.global_limit.take(now):
            raise Refused(Code.RATE_LIMITED, "relay busy")
        if not self.server.device_limit.take(self.device_id, now):
            raise Refused(Code.RATE_LIMITED, "rate limited")


    def _refuse(self, sid: int, request: m.Message | None, exc: Refused) -> None:
        srv = self.server
        srv.rejected[_reason(exc.code)] += 1
        tag = request.TAG if request else None
        if (dropped := srv.quiet.allow(("refused", exc.code, tag))) is not None:
            log.info("sync request refused", extra={"event": "sync_refused",
                                                    "code": exc.code, "reason": exc.message,
                                                    "request": tag, "suppressed": dropped})
        if self.spec_request or self.session.spec:
            self._respond(sid, spec.error(exc.code, exc.message, **self._env()))
            return
        wants = request is not None and self.session.wants_error(request)
        self._respond(sid, m.Error(exc.code, exc.message) if wants else None)

    def _env(self) -> dict:
        """The relay's Envelope fields for this session (engine/sync/envelope.py)."""
        group = self.session.group_id
        return {"group_id": group or spec.ZERO32, "timestamp": unix_now()}


    def notify(self, latest_cursor: int, count: int) -> None:
        """SyncInbox's fan-out: new blobs of the group from other devices. A spec-form
        session gets the spec's NOTIFY, one per blob (its id, sender, time and size)."""
        self.server.touch(self.ticket)
        if not self.session.spec:
            self.send_uni(m.Notify(latest_cursor, count))
            return
        group, now = self.session.group_id, datetime.now(timezone.utc)
        for blob in self.server.inbox.visible(group, max(self.notified,
                                                         latest_cursor - count), latest_cursor,
                                              now):
            if blob.sender != self.device_id:
                self.send_uni(spec.notify(spec.SpecBlob(blob.blob_id, blob.cursor, blob.sender,
                                                        blob.size, blob.timestamp),
                                          **self._env()))
        self.notified = max(self.notified, latest_cursor)


    async def _on_join(self, sid: int, msg: m.Join) -> None:
        ctl, dev = self.server.control, self.device_id
        if ctl.state.is_revoked(msg.group_id, dev):
            raise Refused(Code.DEVICE_REVOKED, "device revoked from this group")
        if not identity.admission_ok(msg.group_id, dev, msg.admitter, msg.expires_at,
                                     msg.signature, time.time()):
            raise Refused(Code.BAD_ADMISSION, "admission invalid or expired")
        outcome = await ctl.admit(msg.group_id, dev, msg.admitter)
        if outcome == "refused":
            raise Refused(Code.BAD_ADMISSION, "admitter is not a member")
        if (dropped := self.server.quiet.allow(("member", outcome))) is not None:
            log.info("sync device joined", extra={"event": "sync_member_changed", "op": outcome,
                                                  "suppressed": dropped})
        self._respond(sid, m.Done(m.Join.TAG))

    async def _on_hello(self, sid: int, msg: m.Hello) -> None:
        srv, ctl, dev = self.server, self.server.control, self.device_id
        self.session.check_hello(msg)
        group = msg.group_id
        # admitted or revoked on another host: looked for in the tables before a refusal
        member = await ctl.known(lambda: ctl.state.is_member(group, dev))
        if ctl.state.is_revoked(group, dev):
            raise Refused(Code.DEVICE_REVOKED, "device revoked from this group")
        if not member:
            if ctl.state.exists(group) and not self.conf.open_groups:
                raise Refused(Code.NOT_A_MEMBER, "not a member of this group")
            outcome = await ctl.admit(group, dev, None, open_group=self.conf.open_groups)
            if outcome == "refused":
                raise Refused(Code.NOT_A_MEMBER, "not a member of this group")
            if (dropped := srv.quiet.allow(("member", outcome))) is not None:
                log.info("sync group member added", extra={"event": "sync_member_changed",
                                                           "op": outcome, "suppressed": dropped})
        # AUTH: the device id is the identity (max_sessions_per_device). Its address or its
        # device at its cap, the session of theirs idle longest and not mid-delivery is
        # closed (code 2) for this one; the total full (fair share only) or every such
        # session mid-delivery, this connection is closed with code 2.
        if self.ticket is not None:
            self.ticket.delivering = self._delivering
        if not srv.advance(self.ticket, Stage.AUTH, dev.hex()):
            self.close(CLOSE_TOO_MANY_SESSIONS, "too many sessions")
            return
        name = limits.truncate_utf8(msg.device_name, self.conf.max_device_name_bytes)
        self.session.activate(msg, name, spec=self.spec_request)
        self._hello_accepted()
        srv.inbox.register(group, self)
        self.registered = True
        srv.last_seen[(group, dev)] = unix_now()
        now = datetime.now(timezone.utc)
        after = max(msg.last_cursor, ctl.state.acked_cursor(group, dev))
        top = srv.inbox.top(group)
        pending = min(srv.inbox.pending_count(group, dev, after, now), m.U32)
        if self.session.spec:          # 002 §5.3 Welcome: relay_id too
            self.notified = top
            self._respond(sid, spec.welcome(msg.version, srv.relay_id, top, pending,
                                            **self._env()))
        else:
            self._respond(sid, m.Welcome(msg.version, top, pending))
        self._deliver_content(group)
        if (dropped := srv.quiet.allow(("session_open", msg.version))) is not None:
            log.info("sync session open", extra={"event": "sync_session_open",
                                                 "version": msg.version, "suppressed": dropped})

    async def _on_push(self, sid: int, msg: m.Push) -> None:
        srv, conf = self.server, self.conf
        group, dev = self.session.group_id, self.device_id
        size = len(msg.payload)
        if size > conf.max_blob_size or len(m.encode(msg)) > conf.max_message_size \
                - PULL_HEADROOM:
            raise Refused(Code.BLOB_TOO_LARGE, "blob too large")
        eid = event_id(group, msg.blob_id)
        srv.inbox.expire(datetime.now(timezone.utc))     # expired blobs leave the quota
        known = srv.inbox.cursor_of(eid)
        if known is not None:             # a re-push: its original cursor
            srv.accepted += 1
            blob = srv.inbox.blob(group, msg.blob_id)
            self._ack(sid, msg.blob_id, known, blob.timestamp if blob else unix_now())
            return
        if srv.inbox.stored(group) + srv.inflight.get(group, 0) + size > conf.max_group_storage:
            raise Refused(Code.QUOTA_EXCEEDED, "group storage quota exceeded")
        srv.inflight[group] = srv.inflight.get(group, 0) + size
        task = asyncio.ensure_future(self._store(sid, msg, group, dev, eid, size))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _store(self, sid: int, msg: m.Push, group: bytes, dev: bytes, eid: bytes,
                     size: int) -> None:
        srv, conf = self.server, self.conf
        received = datetime.now(timezone.utc)
        ts = int(received.timestamp())
        # Never shorter than the wait for the inbox commit: a row that expired before the
        # stream took it would be rejected, and its PUSH would hang until the timeout.
        ttl = limits.effective_ttl(msg.ttl, conf.default_ttl_seconds, conf.max_ttl_seconds,
                                   math.ceil(conf.push_ack_timeout_seconds))
        waiter = srv.inbox.wait(eid)
        try:
            await srv.appender.append({
                C.EVENT_ID: eid, C.PROTOCOL: PROTOCOL, C.MAILBOX: group,
                C.ENVELOPE: msg.payload, C.META: encode_meta(msg.blob_id, dev, ts),
                C.RECEIVED_AT: received, C.EXPIRES_AT: received + timedelta(seconds=ttl)})
            cursor = await asyncio.wait_for(asyncio.shield(waiter),
                                            conf.push_ack_timeout_seconds)
        except Exception as exc:
            srv.inbox.forget_waiter(eid, waiter)
            error = type(exc).__name__
            if (dropped := srv.quiet.allow(("store_failed", error))) is not None:
                log.warning("sync push not stored", extra={"event": "sync_store_failed",
                                                           "error": error, "suppressed": dropped})
            self._refuse(sid, msg, Refused(Code.INTERNAL, "not stored"))
            return
        finally:
            left = srv.inflight.get(group, 0) - size
            if left > 0:
                srv.inflight[group] = left
            else:
                srv.inflight.pop(group, None)
        srv.accepted += 1
        self._ack(sid, msg.blob_id, cursor, ts)

    def _ack(self, sid, blob_id: bytes, cursor: int, ts: int) -> None:
        if self.session.spec:          # 002 §5.3 PushAck: the relay's timestamp too
            self._respond(sid, spec.push_ack(blob_id, cursor, ts, **self._env()))
        else:
            self._respond(sid, m.PushAck(blob_id, cursor))

    async def _on_pull(self, sid: int, msg: m.Pull) -> None:
        srv, conf = self.server, self.conf
        group, dev = self.session.group_id, self.device_id
        limit = limits.clamp_pull_limit(msg.limit, conf.max_pull_limit, conf.default_pull_limit)
        top = srv.inbox.top(group)
        after = msg.after_cursor
        window = min(top, after + conf.cursor_gap_cap)   # F-019: one pull spans <= the cap
        now = datetime.now(timezone.utc)
        picked, room = [], conf.max_message_size - PULL_HEADROOM
        more = False
        for blob in srv.inbox.visible(group, after, window, now):
            if len(picked) == limit:
                more = True
                break
            cost = blob.size * 2 + 40            # upper bound of its encoded entry
            if picked and cost > room:
                more = True
                break
            room -= cost
            picked.append(blob)
        payloads = await srv.inbox.payloads(picked)
        entries = [m.PullBlob(b.blob_id, b.cursor, p, b.timestamp)
                   for b, p in zip(picked, payloads)] if not self.session.spec else []
        if picked:
            max_cursor = picked[-1].cursor
            more = more or any(True for _ in srv.inbox.visible(group, max_cursor, top, now))
        elif window > after:
            # Nothing visible up to the window's end (deleted / expired): move the client on.
            max_cursor = window
            more = window < top
        else:
            max_cursor = after                       # 0k-sync: after_cursor when none
        if 0 < after <= top:
            srv.control.record_ack(group, dev, after)  # pulling after N: holds 1..N
        srv.last_seen[(group, dev)] = unix_now()
        if self.session.spec:          # 002 §5.3 BlobEntry: sender_id too
            self._respond(sid, spec.pull_response(
                [(b.blob_id, b.cursor, b.sender, p, b.timestamp)
                 for b, p in zip(picked, payloads)], more, max_cursor, **self._env()))
        else:
            self._respond(sid, m.PullResponse(entries, more, max_cursor))

    async def _on_bye(self, sid: int, msg: m.Bye) -> None:
        # 0k-sync: no response, Closing; unlike 0k-sync the device leaves the NOTIFY set.
        self.session.close()
        if self.registered:
            self.server.inbox.unregister(self.session.group_id, self)
            self.registered = False
        self._respond(sid, None)

    async def _on_presence(self, sid: int, msg: m.Presence) -> None:
        srv, group = self.server, self.session.group_id
        srv.last_seen[(group, self.device_id)] = unix_now()
        names = {c.device_id: c.session.device_name for c in srv.group_sessions(group)}
        names[self.device_id] = self.session.device_name   # the asking session's own name
        entries = []
        for dev in sorted(srv.control.state.members.get(group, ())):
            online = dev in names and (dev != self.device_id or msg.online)
            entries.append(m.PresenceEntry(dev, names.get(dev, ""), online,
                                           srv.last_seen.get((group, dev), 0)))
        self._respond(sid, m.PresenceList(entries))

    async def _on_ack(self, sid: int, msg: m.Ack) -> None:
        group = self.session.group_id
        self.server.control.record_ack(group, self.device_id,
                                       min(msg.cursor, self.server.inbox.top(group)))
        self._respond(sid, m.Done(m.Ack.TAG))

    async def _on_delete(self, sid: int, msg: m.Delete) -> None:
        srv, group = self.server, self.session.group_id
        blob = srv.inbox.blob(group, msg.blob_id)
        if blob is None:
            raise Refused(Code.NOT_FOUND, "no such blob")
        st = srv.control.state
        waiting = [d for d in st.members.get(group, ())
                   if d != blob.sender and st.acked_cursor(group, d) < blob.cursor]
        if waiting:
            raise Refused(Code.NOT_ACKNOWLEDGED, f"{len(waiting)} device(s) have not "
                          "acknowledged it")
        await srv.acks.append({
            C.PROTOCOL: PROTOCOL, C.MAILBOX: group, C.EVENT_ID: blob.event_id,
            C.SEQ: blob.seq, C.CURSOR: blob.cursor, C.DEVICE: self.device_id,
            C.ACKED_AT: datetime.now(timezone.utc)})
        srv.inbox.remove(group, blob.cursor)
        if (dropped := srv.quiet.allow("blob_deleted")) is not None:
            log.info("sync blob deleted", extra={"event": "sync_blob_deleted",
                                                 "suppressed": dropped})
        self._respond(sid, m.Done(m.Delete.TAG))

    async def _on_revoke(self, sid: int, msg: m.RevokeDevice) -> None:
        srv, group = self.server, self.session.group_id
        if not await srv.control.revoke(group, msg.device_id, self.device_id):
            raise Refused(Code.NOT_FOUND, "not a member")
        if (dropped := srv.quiet.allow(("member", "revoke"))) is not None:
            log.info("sync device revoked", extra={"event": "sync_member_changed", "op": "revoke",
                                                   "suppressed": dropped})
        self._respond(sid, m.Done(m.RevokeDevice.TAG))
        for conn in srv.group_sessions(group):
            conn.send_event(m.DeviceRevoked(msg.device_id))
            if conn.device_id == msg.device_id:
                conn.revoked()

    def revoked(self) -> None:
        """Told DEVICE_REVOKED (just queued): stop serving, close once that had a moment."""
        self.session.close()
        if self.registered:
            self.server.inbox.unregister(self.session.group_id, self)
            self.registered = False
        asyncio.get_running_loop().call_later(0.2, self.close, CLOSE_DEVICE_REVOKED, "device revoked")

    async def _on_register_push(self, sid: int, msg: m.RegisterPush) -> None:
        await self._push_registration(sid, msg, True)

    async def _on_unregister_push(self, sid: int, msg: m.UnregisterPush) -> None:
        await self._push_registration(sid, msg, False)

    async def _push_registration(self, sid: int, msg, register: bool) -> None:
        token = msg.token.encode("utf-8")
        if not (1 <= len(msg.platform) <= 32 and msg.platform.isascii()
                and msg.platform.isprintable() and " " not in msg.platform
                and 1 <= len(token) <= self.conf.max_push_token_bytes):
            raise Refused(Code.INVALID_MESSAGE, "bad platform or token")
        await self.server.control.push_registration(self.session.group_id, self.device_id,
                                                    msg.platform, token, register)
        self._respond(sid, m.Done(msg.TAG))

    async def _on_content(self, sid: int, msg: m.ContentRef | m.ContentAck) -> None:
        """Relayed live to the group's other online devices; the content itself travels
        device to device (iroh-blobs), never through the relay."""
        if isinstance(msg, m.ContentRef) and (
                msg.content_size > limits.MAX_CONTENT_SIZE
                or msg.encrypted_size != msg.content_size + limits.CONTENT_TAG_SIZE):
            raise Refused(Code.CONTENT_TOO_LARGE, "content size invalid or over the limit")
        srv, group = self.server, self.session.group_id
        online = set()
        for conn in srv.group_sessions(group):
            if conn is not self and conn.device_id != self.device_id:
                conn.send_event(msg)
                online.add(conn.device_id)
        # 002 §5.2: CONTENT_REF is for the group's devices, online or not: the members not
        # online now get it after their next WELCOME (`_deliver_content`)
        offline = set(srv.control.state.members.get(group, ())) - online - {self.device_id}
        if offline:
            srv.content_waiting.hold(group, msg, offline, time.monotonic())
        self._respond(sid, m.Done(msg.TAG))

    def send_event(self, msg: m.ContentRef | m.ContentAck | m.DeviceRevoked) -> None:
        """A relay-opened message, as an Envelope to a spec-form session."""
        if self.session.spec:
            self.send_uni(spec.envelope(spec.EXTENSION_TYPES[type(msg)], msg._fields_out(),
                                        sender_id=spec.ZERO32, **self._env()))
        else:
            self.send_uni(msg)

    def _deliver_content(self, group: bytes) -> None:
        """CONTENT_REF / CONTENT_ACK held for this device while it was offline."""
        for msg in self.server.content_waiting.take(group, self.device_id, time.monotonic()):
            self.send_event(msg)



async def drain(conns, timeout: float) -> None:
    """Shutting down: refuse new requests (RELAY_SHUTTING_DOWN), let the PUSHes being stored
    finish and be answered (at most `timeout`), then close every connection (code 0)."""
    for conn in list(conns):
        conn.draining = True
    pending = [t for c in conns for t in c.tasks]
    if pending:
        await asyncio.wait(pending, timeout=timeout)
    for conn in list(conns):
        conn.close(0, "relay shutting down")


def decode_request(body: bytes) -> tuple[m.Message, bool]:
    """A request body -> (message, came as the spec's Envelope)."""
    import msgpack
    try:
        obj = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=False)
    except Exception as exc:
        raise m.DecodeError(f"invalid msgpack: {type(exc).__name__}") from None
    if spec.is_envelope(obj):
        return spec.decode_request(obj).msg, True
    return m.decode_unpacked(obj), False


class ContentWaiting:
    """CONTENT_REF / CONTENT_ACK messages for group members that were offline when they came,
    handed over at their next WELCOME. Bounded: `per_group` messages a group (the oldest
    goes), each kept `ttl` seconds. In memory: a relay restart forgets them (the content
    itself never passes the relay; a sender re-announces what was not acknowledged)."""

    def __init__(self, ttl: float, per_group: int = 256):
        self.ttl, self.per_group = ttl, per_group
        self._held: dict[bytes, list[tuple[float, m.Message, set[bytes]]]] = {}

    def hold(self, group: bytes, msg: m.Message, devices: set[bytes], now: float) -> None:
        held = self._held.setdefault(group, [])
        held.append((now + self.ttl, msg, set(devices)))
        del held[:-self.per_group]

    def take(self, group: bytes, device: bytes, now: float) -> list[m.Message]:
        held = self._held.get(group)
        if not held:
            return []
        out = []
        for _, msg, devices in held:
            if device in devices:
                devices.discard(device)
                out.append(msg)
        held[:] = [h for h in held if h[0] > now and h[2]]
        if not held:
            del self._held[group]
        return out


def _reason(code: int) -> str:
    return {Code.RATE_LIMITED: "rate_limited", Code.QUOTA_EXCEEDED: "quota",
            Code.BLOB_TOO_LARGE: "oversize", Code.NOT_A_MEMBER: "not_member",
            Code.DEVICE_REVOKED: "revoked", Code.BAD_ADMISSION: "bad_admission",
            Code.INTERNAL: "store_failed"}.get(code, "refused")


