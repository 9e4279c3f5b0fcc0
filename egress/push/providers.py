"""The provider clients: APNs, FCM HTTP v1 and Web Push, each through a maintained library.

* HTTP: `httpx` with HTTP/2 (the `h2` package): APNs only speaks HTTP/2, and one connection
  carries every request (APNs asks providers to keep connections open, not to reconnect
  per notification). FCM and Web Push endpoints get the same client (HTTP/2 where the
  server offers it in ALPN, HTTP/1.1 otherwise).
* APNs token auth: an ES256 JWT signed with `PyJWT` (+ `cryptography`), re-signed every 50
  minutes (Apple: valid one hour, refreshed at most every 20 minutes), and at once after
  403 ExpiredProviderToken.
* FCM: `google-auth`'s service-account credentials, the OAuth2 JWT-bearer flow to the
  account's `token_uri`; the token is refreshed when expired or after a 401.
* Web Push: `http_ece` for RFC 8291 aes128gcm encryption to the subscription's keys, and
  `py_vapid` for the VAPID (RFC 8292) JWT: the two libraries pywebpush is made of, used
  directly because pywebpush sends with requests/aiohttp and this job sends with httpx.

A platform without credentials answers DRY_RUN: the job records what it would have sent.
Credentials are never logged; reprs name only the platform.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import ssl
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from engine.push import requests as R
from engine.push.outcomes import Answer, Outcome, classify, retry_after
from engine.push.platforms import APNS, FCM, WEBPUSH, TokenError, parse_subscription
from runtime.config import ApnsConf, FcmConf, WebPushConf
from runtime import logs
from runtime.keys import write_secret_file

log = logging.getLogger("relay.push")
APNS_JWT_SECONDS = 50 * 60
FCM_SCOPE = "https://www.googleapis.com/auth/firebase.messaging"
VAPID_KEY_FILE = "vapid_private.pem"
HEX = frozenset(b"0123456789abcdefABCDEF")


def _client(ca_file: str, timeout: float) -> httpx.AsyncClient:
    verify: ssl.SSLContext | bool = True
    if ca_file:
        verify = ssl.create_default_context(cafile=ca_file)
    return httpx.AsyncClient(http2=True, verify=verify, timeout=timeout,
                             limits=httpx.Limits(max_connections=16,
                                                 max_keepalive_connections=16))


async def _post(client: httpx.AsyncClient, platform: str, url: str, headers: dict,
                body: bytes) -> Answer:
    try:
        r = await client.post(url, headers=headers, content=body)
    except httpx.HTTPError as e:
        return Answer(Outcome.RETRY, f"network:{type(e).__name__}")
    return classify(platform, r.status_code, r.content,
                    retry_after_s=retry_after(r.headers.get("retry-after"), time.time()))


def _session(ca_file: str):
    """A `requests` session for google-auth that trusts `ca_file` ("" = requests' default).
    requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE in the environment override a session's
    `verify` (psf/requests#3829); here the setting wins, proxies still come from the
    environment."""
    import requests

    class Pinned(requests.Session):
        def merge_environment_settings(self, url, proxies, stream, verify, cert):
            out = super().merge_environment_settings(url, proxies, stream, verify, cert)
            if ca_file and verify is None:
                out["verify"] = ca_file
            return out

    session = Pinned()
    if ca_file:
        session.verify = ca_file
    return session


class Provider:
    platform = ""
    configured = False

    async def send(self, token: bytes, collapse: str) -> Answer:
        return Answer(Outcome.DRY_RUN)

    async def refresh(self) -> None:
        """Get a fresh credential (after the provider said the current one expired)."""

    async def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.platform}, configured={self.configured})"


class DryRun(Provider):
    def __init__(self, platform: str, why: str):
        self.platform = platform
        self.why = why


class Apns(Provider):
    platform = APNS
    configured = True

    def __init__(self, conf: ApnsConf, timeout: float):
        import jwt   # PyJWT
        self._jwt = jwt
        self.conf = conf
        self._key = Path(conf.key_file).read_bytes()
        logs.plant(self._key)
        self._token: tuple[str, float] | None = None
        self.client = _client(conf.ca_file, timeout)

    def _bearer(self) -> str:
        now = time.time()
        if self._token is None or now - self._token[1] >= APNS_JWT_SECONDS:
            token = self._jwt.encode({"iss": self.conf.team_id, "iat": int(now)}, self._key,
                                     algorithm="ES256", headers={"kid": self.conf.key_id})
            logs.plant(token)
            self._token = (token, now)
        return self._token[0]

    async def send(self, token: bytes, collapse: str) -> Answer:
        # A token goes into the request path: anything but hex (a Heya IOSA may be any
        # visible ASCII) is not a device token, and is never sent.
        if not (token and all(c in HEX for c in token)):
            return Answer(Outcome.UNREGISTERED, "BadDeviceToken (not hex)")
        headers, body = R.apns(collapse, self.conf.topic, time.time())
        headers["authorization"] = f"bearer {self._bearer()}"
        url = f"{self.conf.url.rstrip('/')}/3/device/{token.decode('ascii', 'replace')}"
        return await _post(self.client, APNS, url, headers, body)

    async def refresh(self) -> None:
        self._token = None

    async def close(self) -> None:
        await self.client.aclose()


class Fcm(Provider):
    platform = FCM
    configured = True

    def __init__(self, conf: FcmConf, timeout: float):
        from google.oauth2 import service_account
        self.conf = conf
        info = json.loads(Path(conf.service_account_file).read_text())
        self.project = info["project_id"]
        logs.plant(info.get("private_key"))
        self.creds = service_account.Credentials.from_service_account_info(
            info, scopes=[FCM_SCOPE])
        self._lock = asyncio.Lock()
        self._session = None
        self.client = _client(conf.ca_file, timeout)

    def _refresh_blocking(self) -> None:
        # google-auth fetches the OAuth2 token with `requests`, which trusts certifi's roots
        # only: the session is told this provider's CA file, as the httpx client is.
        import google.auth.transport.requests
        if self._session is None:
            self._session = _session(self.conf.ca_file)
        self.creds.refresh(google.auth.transport.requests.Request(self._session))
        logs.plant(self.creds.token)

    async def _bearer(self) -> str:
        async with self._lock:
            if not self.creds.valid:
                await asyncio.to_thread(self._refresh_blocking)
            return self.creds.token

    async def send(self, token: bytes, collapse: str) -> Answer:
        try:
            bearer = await self._bearer()
        except Exception as e:   # the token endpoint is down or refused us
            return Answer(Outcome.RETRY, f"oauth:{type(e).__name__}")
        url = f"{self.conf.url.rstrip('/')}/v1/projects/{self.project}/messages:send"
        return await _post(self.client, FCM, url, {
            "authorization": f"Bearer {bearer}", "content-type": "application/json"},
            R.fcm(token.decode("utf-8", "replace"), collapse))

    async def refresh(self) -> None:
        async with self._lock:
            self.creds.token = None
            self.creds.expiry = None

    async def close(self) -> None:
        await self.client.aclose()
        if self._session is not None:
            self._session.close()


def _private_address(host: str) -> bool:
    """Whether `host` is, or resolves to, an address no push service lives at."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False      # unresolvable: the POST fails as a network error
    for info in infos:
        ip = ipaddress.ip_address(info[4][0].split("%")[0])
        if (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved
                or ip.is_multicast or ip.is_unspecified):
            return True
    return False


class WebPush(Provider):
    platform = WEBPUSH
    configured = True

    def __init__(self, conf: WebPushConf, data_dir: str, timeout: float):
        self.conf = conf
        self.vapid = vapid_key(conf, data_dir)
        self.client = _client(conf.ca_file, timeout)

    @property
    def public_key(self) -> bytes:
        return vapid_public_key(self.vapid)

    async def send(self, token: bytes, collapse: str) -> Answer:
        import http_ece
        from cryptography.hazmat.primitives.asymmetric import ec
        try:
            sub = parse_subscription(token.decode("utf-8"))
        except (TokenError, UnicodeDecodeError):
            return Answer(Outcome.UNREGISTERED, "malformed subscription")
        parts = urlsplit(sub.endpoint)
        if not self.conf.allow_private_endpoints and (
                parts.scheme != "https"
                or await asyncio.to_thread(_private_address, parts.hostname or "")):
            return Answer(Outcome.UNREGISTERED, "endpoint not allowed")
        body = http_ece.encrypt(R.WEBPUSH_PLAINTEXT, private_key=ec.generate_private_key(
            ec.SECP256R1()), dh=sub.p256dh, auth_secret=sub.auth, version="aes128gcm")
        aud = f"{parts.scheme}://{parts.netloc}"
        headers = R.webpush_headers(collapse)
        headers.update(self.vapid.sign({"sub": self.conf.vapid_subject, "aud": aud,
                                        "exp": int(time.time()) + 12 * 3600}))
        return await _post(self.client, WEBPUSH, sub.endpoint, headers, body)

    async def close(self) -> None:
        await self.client.aclose()


def vapid_key(conf: WebPushConf, data_dir: str):
    """The relay's VAPID key (a py_vapid Vapid02): `vapid_private_key_file`, else
    `<data>/keys/vapid_private.pem`, created on first use (as the relay's other secrets)."""
    from py_vapid import Vapid02
    path = Path(conf.vapid_private_key_file) if conf.vapid_private_key_file else (
        Path(data_dir).resolve() / "keys" / VAPID_KEY_FILE)
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fresh = Vapid02()
        fresh.generate_keys()
        write_secret_file(path, fresh.private_pem())
    vapid = Vapid02.from_file(str(path))
    logs.plant(vapid.private_key.private_numbers().private_value.to_bytes(32, "big"))
    return vapid


def vapid_public_key(vapid) -> bytes:
    """The applicationServerKey browsers subscribe with (uncompressed P-256)."""
    from cryptography.hazmat.primitives import serialization
    return vapid.public_key.public_bytes(serialization.Encoding.X962,
                                         serialization.PublicFormat.UncompressedPoint)


def providers(conf, data_dir: str) -> dict[str, Provider]:
    """One provider per platform: real where its credentials are configured, else DryRun."""
    timeout = conf.request_timeout_seconds
    out: dict[str, Provider] = {}
    a = conf.apns
    out[APNS] = (Apns(a, timeout) if a.key_file and a.key_id and a.team_id
                 else DryRun(APNS, "push.apns.key_file, key_id and team_id not set"))
    out[FCM] = (Fcm(conf.fcm, timeout) if conf.fcm.service_account_file
                else DryRun(FCM, "push.fcm.service_account_file not set"))
    out[WEBPUSH] = (WebPush(conf.webpush, data_dir, timeout) if conf.webpush.vapid_subject
                    else DryRun(WEBPUSH, "push.webpush.vapid_subject not set"))
    return out
