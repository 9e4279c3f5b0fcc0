"""What a provider's answer means for the wake-up and for the registration.

* SENT: accepted by the provider;
* UNREGISTERED: the token is dead (APNs 410 Unregistered, 400 BadDeviceToken or
  DeviceTokenNotForTopic; FCM 404 / UNREGISTERED; Web Push 404 / 410): spec 004 says the
  (owner, token) row MUST be deleted, so it stops accruing attempts;
* RETRY: try again later (429, 5xx, a network error; an expired APNs provider token or an
  FCM 401 once, after a fresh credential), after `Retry-After` if the provider gave one;
* FAILED: refused for a reason that another try would not change (a malformed request, a
  credential the provider rejects); the token is kept, the wake-up is not retried.
"""

from __future__ import annotations

import enum
import json
import random
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from .platforms import APNS, FCM, WEBPUSH


class Outcome(enum.Enum):
    SENT = "sent"
    UNREGISTERED = "unregistered"
    RETRY = "retry"
    FAILED = "failed"
    DRY_RUN = "dry_run"        # no credentials for the platform: recorded, not sent


@dataclass(frozen=True)
class Answer:
    outcome: Outcome
    reason: str = ""                      # the provider's reason, for logs and push_log
    retry_after: float | None = None      # seconds, when the provider said
    refresh_credential: bool = False      # the provider token / OAuth token expired


def _json(body: bytes) -> dict:
    try:
        d = json.loads(body or b"{}")
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


def retry_after(value: str | None, now: float) -> float | None:
    """RFC 9110 Retry-After: delay-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - now)
    except (TypeError, ValueError):
        return None


def _transient(status: int) -> bool:
    return status == 429 or 500 <= status <= 599


def classify(platform: str, status: int, body: bytes = b"", *,
             retry_after_s: float | None = None) -> Answer:
    if platform == APNS:
        reason = str(_json(body).get("reason", ""))
        if status == 200:
            return Answer(Outcome.SENT)
        if status == 410 or (status == 400 and reason in ("BadDeviceToken",
                                                          "DeviceTokenNotForTopic")):
            return Answer(Outcome.UNREGISTERED, reason or str(status))
        if status == 403 and reason == "ExpiredProviderToken":
            return Answer(Outcome.RETRY, reason, retry_after_s, refresh_credential=True)
        if _transient(status):
            return Answer(Outcome.RETRY, reason or str(status), retry_after_s)
        return Answer(Outcome.FAILED, reason or str(status))
    if platform == FCM:
        err = _json(body).get("error")
        err = err if isinstance(err, dict) else {}
        codes = {str(err.get("status", ""))}
        for detail in err.get("details") or ():
            if isinstance(detail, dict) and detail.get("errorCode"):
                codes.add(str(detail["errorCode"]))
        codes.discard("")
        reason = ",".join(sorted(codes)) or str(status)
        if status == 200:
            return Answer(Outcome.SENT)
        if status == 404 or "UNREGISTERED" in codes:
            return Answer(Outcome.UNREGISTERED, reason)
        if status == 401:
            return Answer(Outcome.RETRY, reason, retry_after_s, refresh_credential=True)
        if _transient(status):
            return Answer(Outcome.RETRY, reason, retry_after_s)
        return Answer(Outcome.FAILED, reason)
    if platform == WEBPUSH:
        if status in (200, 201, 202):
            return Answer(Outcome.SENT)
        if status in (404, 410):
            return Answer(Outcome.UNREGISTERED, str(status))
        if _transient(status):
            return Answer(Outcome.RETRY, str(status), retry_after_s)
        return Answer(Outcome.FAILED, str(status))
    return Answer(Outcome.FAILED, "unsupported platform")


def backoff(attempt: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Seconds before retry `attempt` (1, 2, ...): full jitter over an exponential bound
    (AWS's "exponential backoff and jitter"), so a provider outage is not answered by every
    device's retry at the same instant."""
    bound = min(cap, base * (2 ** max(0, attempt - 1)))
    return (rng or random).uniform(0, bound)
