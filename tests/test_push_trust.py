"""Provider clients trust what their settings say: FCM over TLS with a certificate from a
private CA made here (no system root signs it), for both the OAuth2 token fetch (google-auth)
and the FCM v1 request. The push job, with `push.fcm.ca_file` set, wakes the device; without
it the token fetch fails on the certificate and no FCM request is made."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import os
import time

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from delta_tables.layout import Layout
from egress.push.job import PushJob
from egress.push.providers import providers
from relay.bench.push_providers import FakeFcm
from runtime.push_desk import Device, PushDesk, desk_dir
from test_push_job import commit_rows, outcomes


def private_ca(directory) -> tuple:
    """(CA certificate file, server chain file, server key file): a CA of our own and a
    certificate it signed for 127.0.0.1."""
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "relay test private CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    ca_file, chain, key_file = (directory / "ca.pem", directory / "server-chain.pem",
                                directory / "server-key.pem")
    ca_file.write_bytes(ca.public_bytes(pem))
    chain.write_bytes(leaf.public_bytes(pem) + ca.public_bytes(pem))
    key_file.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return ca_file, chain, key_file


class FcmListener:
    """A desk backend: every mailbox has one FCM device, offline."""

    def wake(self, mailbox, cursor, meta):
        return [Device(mailbox, "fcm", b"fcm-registration-" + mailbox.hex().encode(), None)]

    def owner(self, owner):
        return False, [Device(owner, "fcm", b"fcm-registration-" + owner.hex().encode(), None)]

    async def drop(self, owner, platform, token):
        return True

    def pending(self):
        return []


async def _wake_one(settings, fcm: FakeFcm, mailbox: bytes) -> list[dict]:
    """Run the push job until the wake-up for `mailbox` has an outcome; its push_log rows."""
    layout = Layout.of(settings)
    layout.ensure_shared_tables()
    settings.push.window_seconds = 0
    settings.push.max_attempts = 1
    job = PushJob(settings, providers(settings.push, settings.data_dir))
    await job.start()
    desk = await PushDesk.open(desk_dir(settings.data_dir), "ppp", FcmListener())
    try:
        commit_rows(layout, [mailbox])
        t0 = time.monotonic()
        while not [r for r in outcomes(layout) if r["platform"] == "fcm"]:
            await job.step()
            await job._commit_outcomes(force=True)
            assert time.monotonic() - t0 < 30, "no FCM outcome"
            await asyncio.sleep(0.05)
    finally:
        await job.close()
        desk.close()
    return [r for r in outcomes(layout) if r["platform"] == "fcm"]


def _run_against_private_fcm(settings, tmp_path, trust_ca: bool) -> tuple[list[dict], FakeFcm]:
    """A wake-up through a fake FCM on TLS from our private CA; `push.fcm.ca_file` names
    that CA or is empty (system roots: our CA is not one of them)."""
    ca_file, chain, key = private_ca(tmp_path)
    fcm = FakeFcm(tmp_path, tls=(chain, key))

    async def main():
        await fcm.start()
        try:
            fcm.conf(settings)
            assert fcm.url.startswith("https://")
            settings.push.fcm.ca_file = str(ca_file) if trust_ca else ""
            return await _wake_one(settings, fcm, os.urandom(32))
        finally:
            await fcm.close()
    return asyncio.run(main()), fcm


def test_fcm_token_fetch_and_send_trust_the_configured_private_ca(settings, tmp_path):
    rows, fcm = _run_against_private_fcm(settings, tmp_path, trust_ca=True)
    assert [r["outcome"] for r in rows] == ["sent"], rows
    assert fcm.token_requests == 1 and len(fcm.requests) == 1


def test_without_the_ca_the_token_fetch_fails_on_the_certificate(settings, tmp_path):
    rows, fcm = _run_against_private_fcm(settings, tmp_path, trust_ca=False)
    assert [r["outcome"] for r in rows] == ["retry_exhausted"], rows
    assert fcm.token_requests == 0 and fcm.requests == []
