"""Push providers on loopback, answering as their documentation says, for the push tests
(tests/test_push.py, tests/test_crash_push.py) and `relay bench` (push.py).

The relay's provider clients (egress/push/providers.py) are the production code path; only
the base URLs in `conf` point here. Every request is recorded (path, headers, body), and
what a token gets back is scripted per token.

* APNs (https://developer.apple.com/documentation/usernotifications/sending-notification-requests-to-apns):
  HTTP/2 only, over TLS with ALPN h2 (the `h2` library); POST /3/device/<token>; token auth:
  `authorization: bearer <ES256 JWT>` with `kid` and `iss`, checked against the key here;
  200 with an `apns-id` header, errors as JSON `{"reason": ...}` (410 adds `timestamp`).
* FCM HTTP v1 (https://firebase.google.com/docs/reference/fcm/rest/v1/projects.messages/send):
  POST /v1/projects/<project>/messages:send with `Authorization: Bearer <access token>`;
  the OAuth2 token endpoint (RFC 7523 JWT bearer grant) at /token checks the assertion's
  RS256 signature with the service account's key; errors as google.rpc.Status JSON with
  `FcmError` details (UNREGISTERED).
* Web Push (RFC 8030 / 8291 / 8292): POST /wp/<id>, 201 Created; the test decrypts what
  arrived with the subscription's private key.
HTTP/1.1 servers are uvicorn with a bare ASGI app.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import ipaddress
import json
import os
import ssl
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import jwt
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Script:
    """Per token: the statuses to answer in order (the last one repeats); default 200."""
    answers: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)

    def next(self, token: str) -> int:
        seq = self.answers.get(token)
        if not seq:
            return 200
        return seq.pop(0) if len(seq) > 1 else seq[0]


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (its own CA) and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "provider-cert.pem", directory / "provider-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


# --- APNs ------------------------------------------------------------------------------------

class FakeApns:
    TEAM = "TEAM123456"
    KEY_ID = "KEY1234567"
    TOPIC = "org.example.messenger"

    def __init__(self, directory: Path):
        self.directory = directory
        self.signing_key = ec.generate_private_key(ec.SECP256R1())
        self.key_file = directory / "AuthKey.p8"
        self.key_file.write_bytes(self.signing_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        self.cert, self.key = self_signed(directory)
        self.requests: list[Request] = []
        self.arrival_times: list[tuple[float, str, str]] = []   # (unix s, token, collapse id)
        self.script = Script(reasons={400: "BadDeviceToken", 410: "Unregistered",
                                      429: "TooManyRequests", 503: "ServiceUnavailable",
                                      500: "InternalServerError"})
        self.bad_auth = 0
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def conf(self, settings) -> None:
        a = settings.push.apns
        a.key_file, a.key_id, a.team_id, a.topic = (str(self.key_file), self.KEY_ID, self.TEAM,
                                                    self.TOPIC)
        a.url, a.ca_file = self.url, str(self.cert)

    async def start(self) -> None:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        ctx.set_alpn_protocols(["h2"])
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=ctx)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def _answer(self, headers: dict[str, str], body: bytes) -> tuple[int, dict, bytes]:
        path = headers[":path"]
        self.requests.append(Request(path, headers, body))
        self.arrival_times.append((time.time(), path.rsplit("/", 1)[-1],
                                   headers.get("apns-collapse-id", "")))
        try:
            auth = headers.get("authorization", "")
            assert auth.startswith("bearer ")
            token = auth[len("bearer "):]
            assert jwt.get_unverified_header(token)["kid"] == self.KEY_ID
            claims = jwt.decode(token, self.signing_key.public_key(), algorithms=["ES256"])
            assert claims["iss"] == self.TEAM
            assert headers.get("apns-topic") == self.TOPIC
        except Exception:
            self.bad_auth += 1
            return 403, {}, json.dumps({"reason": "InvalidProviderToken"}).encode()
        device = path.rsplit("/", 1)[-1]
        status = self.script.next(device)
        out = {"apns-id": headers.get("apns-id", "00000000-0000-0000-0000-000000000000")}
        if status == 200:
            return 200, out, b""
        reason = {"reason": self.script.reasons.get(status, "Error")}
        if status == 410:
            reason["timestamp"] = 1700000000000
        extra = {"retry-after": "0"} if status in (429, 503) else {}
        return status, {**out, **extra}, json.dumps(reason).encode()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False,
                                                                    header_encoding="utf-8"))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        streams: dict[int, tuple[dict, bytearray]] = {}
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        streams[event.stream_id] = (dict(event.headers), bytearray())
                    elif isinstance(event, h2.events.DataReceived):
                        streams[event.stream_id][1].extend(event.data)
                        conn.acknowledge_received_data(event.flow_controlled_length,
                                                       event.stream_id)
                    elif isinstance(event, h2.events.StreamEnded):
                        headers, body = streams.pop(event.stream_id)
                        status, out, payload = self._answer(headers, bytes(body))
                        conn.send_headers(event.stream_id, [(":status", str(status))] + [
                            (k, v) for k, v in out.items()] + [
                            ("content-length", str(len(payload)))],
                            end_stream=not payload)
                        if payload:
                            conn.send_data(event.stream_id, payload, end_stream=True)
                writer.write(conn.data_to_send())
                await writer.drain()
        except (ConnectionError, ssl.SSLError, h2.exceptions.ProtocolError):
            pass
        finally:
            writer.close()


# --- HTTP/1.1 providers (FCM with its OAuth2 endpoint, Web Push) -------------------------------

class _Http11:
    def __init__(self, tls: tuple[Path, Path] | None = None) -> None:
        self.tls = tls   # (certificate chain, key) PEM files: serve HTTPS
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        config = uvicorn.Config(self._asgi, host="127.0.0.1", port=0, log_config=None,
                                access_log=False, lifespan="off", log_level="warning",
                                interface="asgi3",
                                ssl_certfile=str(self.tls[0]) if self.tls else None,
                                ssl_keyfile=str(self.tls[1]) if self.tls else None)
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._task

    async def _asgi(self, scope, receive, send) -> None:
        body = bytearray()
        while True:
            msg = await receive()
            body.extend(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        status, out, payload = self.answer(scope["path"], headers, bytes(body))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(k.encode(), v.encode()) for k, v in out.items()]})
        await send({"type": "http.response.body", "body": payload})

    def answer(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict, bytes]:
        raise NotImplementedError


class FakeFcm(_Http11):
    PROJECT = "relay-test-project"

    def __init__(self, directory: Path, tls: tuple[Path, Path] | None = None):
        super().__init__(tls)
        self.rsa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.account_file = directory / "service-account.json"
        self.requests: list[Request] = []
        self.token_requests = 0
        self.tokens: set[str] = set()
        self.script = Script()
        self.expire_next_token = False

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    async def start(self) -> None:
        await super().start()
        pem = self.rsa.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()).decode()
        self.account_file.write_text(json.dumps({
            "type": "service_account", "project_id": self.PROJECT, "private_key_id": "k1",
            "private_key": pem, "client_email": "relay@relay-test-project.iam.gserviceaccount.com",
            "client_id": "1", "token_uri": f"{self.url}/token"}))

    def conf(self, settings) -> None:
        settings.push.fcm.service_account_file = str(self.account_file)
        settings.push.fcm.url = self.url

    def answer(self, path, headers, body):
        if path == "/token":
            form = urllib.parse.parse_qs(body.decode())
            assert form["grant_type"] == ["urn:ietf:params:oauth:grant-type:jwt-bearer"]
            claims = jwt.decode(form["assertion"][0], self.rsa.public_key(), algorithms=["RS256"],
                                # google-auth names Google's endpoint whatever token_uri says
                                audience="https://oauth2.googleapis.com/token")
            assert "firebase.messaging" in claims["scope"]
            self.token_requests += 1
            token = base64.urlsafe_b64encode(os.urandom(24)).decode()
            self.tokens.add(token)
            return 200, {"content-type": "application/json"}, json.dumps(
                {"access_token": token, "expires_in": 3600, "token_type": "Bearer"}).encode()
        self.requests.append(Request(path, headers, body))
        assert path == f"/v1/projects/{self.PROJECT}/messages:send"
        bearer = headers.get("authorization", "")[len("Bearer "):]
        if bearer not in self.tokens or self.expire_next_token:
            self.expire_next_token = False
            self.tokens.discard(bearer)
            return 401, {"content-type": "application/json"}, json.dumps({"error": {
                "code": 401, "status": "UNAUTHENTICATED",
                "message": "Request had invalid authentication credentials."}}).encode()
        token = json.loads(body)["message"]["token"]
        status = self.script.next(token)
        if status == 200:
            return 200, {"content-type": "application/json"}, json.dumps(
                {"name": f"projects/{self.PROJECT}/messages/0:{len(self.requests)}"}).encode()
        code = {404: "UNREGISTERED", 429: "QUOTA_EXCEEDED", 503: "UNAVAILABLE",
                400: "INVALID_ARGUMENT"}.get(status, "INTERNAL")
        status_name = {404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE",
                       400: "INVALID_ARGUMENT"}.get(status, "INTERNAL")
        extra = {"retry-after": "0"} if status in (429, 503) else {}
        return status, {"content-type": "application/json", **extra}, json.dumps({"error": {
            "code": status, "status": status_name, "message": "error",
            "details": [{"@type": "type.googleapis.com/google.firebase.fcm.v1.FcmError",
                         "errorCode": code}]}}).encode()


class FakeWebPush(_Http11):
    def __init__(self):
        super().__init__()
        self.requests: list[Request] = []
        self.script = Script()

    def subscription(self, name: str) -> tuple[str, ec.EllipticCurvePrivateKey, bytes]:
        """(PushSubscription JSON, the browser's private key, its auth secret)."""
        priv = ec.generate_private_key(ec.SECP256R1())
        pub = priv.public_key().public_bytes(serialization.Encoding.X962,
                                             serialization.PublicFormat.UncompressedPoint)
        auth = os.urandom(16)
        b64 = lambda b: base64.urlsafe_b64encode(b).rstrip(b"=").decode()  # noqa: E731
        sub = {"endpoint": f"http://127.0.0.1:{self.port}/wp/{name}",
               "keys": {"p256dh": b64(pub), "auth": b64(auth)}}
        return json.dumps(sub), priv, auth

    def answer(self, path, headers, body):
        self.requests.append(Request(path, headers, body))
        status = self.script.next(path.rsplit("/", 1)[-1])
        return (201 if status == 200 else status), {}, b""
