"""The BLE courier's shells (spec 004 §8): thin asyncio code over `engine/ppp/courier.py`.

* `CourierGatt`: the courier's GATT server logic, what a peripheral library calls on a read
  or a write, and what it notifies. `serve_bless` puts it on the air with `bless` (BlueZ over
  D-Bus on Linux, CoreBluetooth, WinRT).
* `receive`: the recipient's (or a second courier's) side over any `GattClient`, which is
  the part of `bleak.BleakClient` it uses; `scan_and_receive` finds a courier with bleak's
  scanner and runs it over a real connection.
* `LoopbackLink`: a `GattClient` wired to a `CourierGatt` in memory, carrying the same reads,
  writes and notifications; the tests and `--loopback` use it where there is no adapter.

Why the courier is the server: see `engine/ppp/courier.py` (§8 has it notify EVENT_STREAM).
One session at a time: peripheral libraries do not say which central a read or a write came
from (bless drops BlueZ's `device` option), so reading HANDSHAKE_NONCE starts a new session
and ends the previous one. A central that fails AUTH_RESPONSE makes the courier refuse new
sessions for `auth_cooldown` seconds (§8's "rate limiting prevents enumeration").

Nothing here logs a key, an event id or a device address.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Awaitable, Callable, Protocol

from engine.ppp import courier as C

log = logging.getLogger("relay.courier")

DEFAULT_MTU = C.MIN_MTU        # what every BLE link supports; a real link may negotiate more


class GattClient(Protocol):
    """What `receive` needs of a connected central: bleak's BleakClient methods."""
    @property
    def mtu_size(self) -> int: ...
    async def read_gatt_char(self, char: str) -> bytearray: ...
    async def write_gatt_char(self, char: str, data: bytes, response: bool = True) -> None: ...
    async def start_notify(self, char: str, callback: Callable) -> None: ...
    async def stop_notify(self, char: str) -> None: ...


class GattRefused(Exception):
    """The server refused a read or a write (an ATT error on a real link)."""


class CourierGatt:
    """The courier's side of §8 for a peripheral library: `read(uuid)`, `write(uuid, data)`;
    `notify(uuid, chunk)` is set by the shell (bless, or a LoopbackLink)."""

    def __init__(self, store: C.CourierStore, *, carried_for: frozenset[bytes],
                 couriers: frozenset[bytes] = frozenset(), mtu: int = DEFAULT_MTU,
                 clock: Callable[[], float] = time.time, auth_cooldown: float = 1.0):
        C.chunk_payload(mtu)
        self.store = store
        self.carried_for = carried_for
        self.couriers = couriers
        self.mtu = mtu
        self.clock = clock
        self.auth_cooldown = auth_cooldown
        self.notify: Callable[[str, bytes], None] = lambda uuid, data: None
        self.session: C.CourierSession | None = None
        self.delivered: list[bytes] = []      # event ids recipients acked (for ACK_CARRY)
        self.handed_on: list[bytes] = []      # event ids another courier took
        self.failed_auths = 0
        self._quiet_until = 0.0

    def __repr__(self) -> str:
        return f"CourierGatt(carrying={len(self.store.events)}, delivered={len(self.delivered)})"

    def read(self, uuid: str) -> bytes:
        if uuid.lower() != C.HANDSHAKE_NONCE_UUID:
            raise GattRefused("not readable")
        now = self.clock()
        if now < self._quiet_until:
            raise GattRefused("busy")
        self.session = C.CourierSession(self.store, self.mtu, int(now),
                                        carried_for=self.carried_for, couriers=self.couriers)
        return self.session.nonce

    def write(self, uuid: str, data: bytes) -> None:
        uuid, s = uuid.lower(), self.session
        if s is None:
            raise GattRefused("read the nonce first")
        data = bytes(data)
        try:
            if uuid == C.AUTH_RESPONSE_UUID:
                s.on_auth(data)
                self._stream()
            elif uuid == C.EVENT_ACK_UUID:
                if s.on_ack(data):
                    (self.delivered if s.peer in self.carried_for else self.handed_on).append(data)
            else:
                raise GattRefused("not writable")
        except C.CourierError:
            if s.closed:
                self.failed_auths += 1
                self._quiet_until = self.clock() + self.auth_cooldown
                self.session = None
            raise GattRefused("refused") from None

    def _stream(self) -> None:
        for chunk in self.session.notifications():
            self.notify(C.EVENT_STREAM_UUID, chunk)


class LoopbackLink:
    """A `GattClient` connected to a `CourierGatt` in memory: the exact reads, writes and
    notifications of a BLE link, delivered in order on the running loop."""

    def __init__(self, gatt: CourierGatt, mtu: int | None = None):
        self.gatt = gatt
        self._mtu = mtu or gatt.mtu
        self._callbacks: dict[str, Callable] = {}
        self.notifications = 0
        gatt.notify = self._notified

    @property
    def mtu_size(self) -> int:
        return self._mtu

    def _notified(self, uuid: str, data: bytes) -> None:
        if len(data) > self._mtu - C.ATT_HEADER:
            raise AssertionError("a notification larger than the link's MTU")
        cb = self._callbacks.get(uuid)
        if cb is not None:
            self.notifications += 1
            asyncio.get_running_loop().call_soon(cb, uuid, bytearray(data))

    async def read_gatt_char(self, char: str) -> bytearray:
        return bytearray(self.gatt.read(char))

    async def write_gatt_char(self, char: str, data: bytes, response: bool = True) -> None:
        self.gatt.write(char, bytes(data))
        await asyncio.sleep(0)

    async def start_notify(self, char: str, callback: Callable) -> None:
        self._callbacks[char] = callback

    async def stop_notify(self, char: str) -> None:
        self._callbacks.pop(char, None)


async def receive(client: GattClient, side: C.RecipientSession | C.TransferSession, *,
                  idle: float = 2.0) -> int:
    """One session as the central: subscribe, read the nonce, authenticate, take events
    until none arrive for `idle` seconds, writing an EVENT_ACK for each. Returns how many
    events completed. A refused AUTH_RESPONSE raises GattRefused (the courier ends the
    session the same way for every reason: not carried for, or a bad key)."""
    chunks: asyncio.Queue[bytes] = asyncio.Queue()
    await client.start_notify(C.EVENT_STREAM_UUID, lambda _c, data: chunks.put_nowait(bytes(data)))
    done = 0
    try:
        nonce = bytes(await client.read_gatt_char(C.HANDSHAKE_NONCE_UUID))
        await client.write_gatt_char(C.AUTH_RESPONSE_UUID, side.on_nonce(nonce), response=True)
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.get(), idle)
            except (asyncio.TimeoutError, TimeoutError):
                return done
            got = side.on_notification(chunk)
            ack = got[1] if isinstance(got, tuple) else got
            if ack is not None:
                done += 1
                await client.write_gatt_char(C.EVENT_ACK_UUID, ack, response=True)
    finally:
        await client.stop_notify(C.EVENT_STREAM_UUID)


# --- on the air -----------------------------------------------------------------------------------

def bluetooth_absent() -> str | None:
    """Why this machine cannot do BLE, or None when it may (Linux: an adapter under
    /sys/class/bluetooth and BlueZ's system bus; other systems are left to the library)."""
    if os.name != "posix" or not os.path.isdir("/sys"):
        return None
    try:
        adapters = os.listdir("/sys/class/bluetooth")
    except OSError:
        adapters = []
    if not adapters:
        return "no Bluetooth adapter on this machine (/sys/class/bluetooth is empty)"
    if not os.path.exists("/run/dbus/system_bus_socket"):
        return "no D-Bus system bus, so no BlueZ (Bluetooth) here"
    return None


async def serve_bless(gatt: CourierGatt, *, name: str = "PPP",
                      stop: Awaitable | None = None) -> None:
    """Advertise the courier service with `bless` and answer until `stop` resolves (or for
    ever). Notifications set the characteristic's value and ask bless to notify it."""
    from bless import (BlessServer, GATTAttributePermissions as Perm,
                       GATTCharacteristicProperties as Prop)
    server = BlessServer(name=name)
    server.read_request_func = lambda char, **_: bytearray(gatt.read(str(char.uuid)))

    def on_write(char, value, **_):
        try:
            gatt.write(str(char.uuid), bytes(value))
        except GattRefused:
            pass        # BlueZ's write already returned; the session is over or unchanged

    server.write_request_func = on_write

    def notify(uuid: str, data: bytes) -> None:
        server.get_characteristic(uuid).value = bytearray(data)
        server.update_value(C.SERVICE_UUID, uuid)

    gatt.notify = notify
    await server.add_new_service(C.SERVICE_UUID)
    for uuid, props, perms in (
            (C.HANDSHAKE_NONCE_UUID, Prop.read, Perm.readable),
            (C.AUTH_RESPONSE_UUID, Prop.write, Perm.writeable),
            (C.EVENT_STREAM_UUID, Prop.notify, Perm.readable),
            (C.EVENT_ACK_UUID, Prop.write, Perm.writeable)):
        await server.add_new_characteristic(C.SERVICE_UUID, uuid, props, None, perms)
    await server.start()
    try:
        await (stop if stop is not None else asyncio.Event().wait())
    finally:
        await server.stop()


async def scan_and_receive(side: C.RecipientSession | C.TransferSession, *,
                           timeout: float = 30.0, idle: float = 5.0) -> int:
    """Find a courier advertising the service (bleak), connect, and `receive`."""
    from bleak import BleakClient, BleakScanner
    device = await BleakScanner.find_device_by_filter(
        lambda _d, adv: C.SERVICE_UUID in [u.lower() for u in adv.service_uuids],
        timeout=timeout)
    if device is None:
        return 0
    async with BleakClient(device) as client:
        return await receive(client, side, idle=idle)
