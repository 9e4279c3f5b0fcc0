"""What each provider is sent: a wake signal and nothing else (spec 004: "Push payloads MUST
NOT contain event content — they serve only as wake signals for the client to FETCH").

No event bytes, no sender, no room or group id, no mailbox: the app learns what is waiting
by connecting and fetching. Every request carries a collapse id derived from (device, the
wake-up's time), so a wake-up re-sent after a crash replaces the first on the device
instead of showing twice (APNs `apns-collapse-id`, FCM `collapse_key`, Web Push `Topic`).

* APNs: an alert push with a localisation key the app translates ("New message") and
  `mutable-content`, so the app's notification extension can fetch before it shows;
  priority 10, expiring after a day (a phone off for longer fetches when it opens).
* FCM (HTTP v1): a high-priority data message `{"wake": "1"}`: the app fetches in the
  background and shows its own notification.
* Web Push: the encrypted (RFC 8291) body `{"wake":1}`, `Urgency: high`.
"""

from __future__ import annotations

import hashlib
import json
import uuid

WAKE_TTL_SECONDS = 86400
APNS_LOC_KEY = "PPP_NEW_MESSAGE"


def collapse_id(device: bytes, wake_at_us: int) -> str:
    """16 hex digits: fits APNs (64 bytes), FCM and Web Push's Topic (32 base64url chars)."""
    return hashlib.blake2b(device + wake_at_us.to_bytes(8, "big"), digest_size=8).hexdigest()


def apns(collapse: str, topic: str, now: float) -> tuple[dict[str, str], bytes]:
    headers = {
        "apns-push-type": "alert",
        "apns-priority": "10",
        "apns-expiration": str(int(now) + WAKE_TTL_SECONDS),
        "apns-collapse-id": collapse,
        # Deterministic too, so the provider's log of a re-sent wake-up shows the same id.
        "apns-id": str(uuid.UUID(bytes=hashlib.blake2b(collapse.encode(), digest_size=16)
                                 .digest())),
    }
    if topic:
        headers["apns-topic"] = topic
    body = {"aps": {"alert": {"loc-key": APNS_LOC_KEY}, "mutable-content": 1,
                    "sound": "default"}}
    return headers, json.dumps(body, separators=(",", ":")).encode()


def fcm(token: str, collapse: str) -> bytes:
    message = {"message": {
        "token": token,
        "data": {"wake": "1"},
        "android": {"priority": "HIGH", "collapse_key": collapse,
                    "ttl": f"{WAKE_TTL_SECONDS}s"},
    }}
    return json.dumps(message, separators=(",", ":")).encode()


WEBPUSH_PLAINTEXT = b'{"wake":1}'


def webpush_headers(collapse: str) -> dict[str, str]:
    return {"TTL": str(WAKE_TTL_SECONDS), "Urgency": "high", "Topic": collapse,
            "Content-Encoding": "aes128gcm", "Content-Type": "application/octet-stream"}
