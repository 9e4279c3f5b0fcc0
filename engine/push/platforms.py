"""The push platforms a registration may name, and what a well-formed token of each is.

* `apns`: an APNs device token, hex (Apple's are 32 bytes, 64 hex digits; the length is not
  promised, so 16-200 hex digits);
* `fcm`: an FCM registration token, 1-4096 printable ASCII bytes;
* `webpush`: a Web Push subscription as the browser's `PushSubscription.toJSON()` gives it,
  `{"endpoint": "https://...", "keys": {"p256dh": b64url, "auth": b64url}}` (RFC 8030 / RFC
  8291), at most 4096 bytes. UnifiedPush distributors hand out the same shape.

A protocol whose registration has no platform (Heya's IOSA: iOS devices) registers `apns`.
Another protocol may store a platform this relay cannot send to (cursor-sync accepts any
short string): the push job records such a wake as `unsupported` and sends nothing.
"""

from __future__ import annotations

import base64
import binascii
import json
import string
from dataclasses import dataclass
from urllib.parse import urlsplit

APNS = "apns"
FCM = "fcm"
WEBPUSH = "webpush"
PLATFORMS = (APNS, FCM, WEBPUSH)
MAX_TOKEN_BYTES = 4096
_HEX = frozenset(string.hexdigits)


class TokenError(ValueError):
    """A registration this relay would never be able to send to."""


@dataclass(frozen=True)
class Subscription:
    """A Web Push subscription: where to POST, and the keys the payload is encrypted to."""
    endpoint: str
    p256dh: bytes      # the user agent's P-256 public key, uncompressed (65 bytes)
    auth: bytes        # the 16-byte auth secret

    def __repr__(self) -> str:   # the endpoint is a bearer capability: never shown
        return "Subscription()"


def _b64url(s: object, what: str) -> bytes:
    if not isinstance(s, str):
        raise TokenError(f"{what} must be base64url text")
    try:
        return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))
    except (binascii.Error, ValueError):
        raise TokenError(f"{what} is not base64url") from None


def parse_subscription(token: str) -> Subscription:
    try:
        d = json.loads(token)
    except (ValueError, RecursionError):
        raise TokenError("a webpush token is a PushSubscription JSON object") from None
    if not isinstance(d, dict) or not isinstance(d.get("keys"), dict):
        raise TokenError("a webpush token needs endpoint and keys")
    endpoint = d.get("endpoint")
    if not isinstance(endpoint, str):
        raise TokenError("endpoint must be a URL")
    parts = urlsplit(endpoint)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise TokenError("endpoint must be an http(s) URL")
    p256dh = _b64url(d["keys"].get("p256dh"), "p256dh")
    auth = _b64url(d["keys"].get("auth"), "auth")
    if len(p256dh) != 65 or p256dh[0] != 4:
        raise TokenError("p256dh must be an uncompressed P-256 point")
    if len(auth) != 16:
        raise TokenError("auth must be 16 bytes")
    return Subscription(endpoint, p256dh, auth)


def check_token(platform: str, token: str) -> None:
    """Raises TokenError unless `token` is a well-formed token of `platform` (one of
    PLATFORMS)."""
    if platform not in PLATFORMS:
        raise TokenError(f"platform must be one of {', '.join(PLATFORMS)}")
    if not 1 <= len(token.encode("utf-8")) <= MAX_TOKEN_BYTES:
        raise TokenError("token must be 1-4096 bytes")
    if platform == APNS:
        if not (16 <= len(token) <= 200 and all(c in _HEX for c in token)):
            raise TokenError("an apns token is 16-200 hex digits")
    elif platform == FCM:
        if not all(0x21 <= ord(c) <= 0x7E for c in token):
            raise TokenError("an fcm token is printable ASCII")
    else:
        parse_subscription(token)
