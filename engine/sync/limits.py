"""The hardening table (seed 5.4, 0k-sync `config.rs` defaults): the built-in values of
`runtime.config.SyncConf`, which an operator may change. Each says what it protects."""

# ST-001: the transport refuses a frame over this before deserialising it (len == MAX allowed).
MAX_MESSAGE_SIZE = 1_048_576
# F-006: HELLO must arrive (auth included) this soon after the connection opens.
HELLO_TIMEOUT_SECONDS = 10.0
# Not in 0k-sync (an opened but silent stream blocked its session forever, interop §3): a
# request stream must deliver its frame and FIN within this.
STREAM_READ_TIMEOUT_SECONDS = 10.0
# F-007: concurrent connections; past it the connection is closed with code 2.
MAX_CONCURRENT_SESSIONS = 10_000
# Per device id: new connections per minute (governor burst = the count); code 1 past it.
CONNECTIONS_PER_MINUTE = 10
# Per device id, PUSH and PULL: burst 100, one more every 600 ms.
MESSAGES_PER_MINUTE = 100
# SR-001: PUSH and PULL of all clients together, per second (burst = the count).
GLOBAL_REQUESTS_PER_SECOND = 1000
# F-013: a PULL asks for at most this many blobs; 0 means DEFAULT_PULL_LIMIT.
MAX_PULL_LIMIT = 1000
DEFAULT_PULL_LIMIT = 100
# F-019: one PULL never spans more than this many cursors after `after_cursor`.
CURSOR_GAP_CAP = 10_000
# F-012: device names are cut to this many UTF-8 bytes, never inside a character.
MAX_DEVICE_NAME_BYTES = 256
# TTL: 0 means the default; anything longer is clamped (0k-sync has no upper clamp); the
# shell raises anything shorter than `push_ack_timeout_seconds` to it.
DEFAULT_TTL_SECONDS = 7 * 24 * 3600
MAX_TTL_SECONDS = 30 * 24 * 3600
# Per group: sum of stored payload bytes (pushes in flight included).
MAX_GROUP_STORAGE = 100 * 1024 * 1024
# A single payload (0k-sync storage.max_blob_size; the frame cap hits first at ~699 KB).
MAX_BLOB_SIZE = 1_048_576
# F-017: CONTENT_REF may announce at most this much content (it never passes the relay).
MAX_CONTENT_SIZE = 100 * 1024 * 1024
# XChaCha20-Poly1305 tag: encrypted_size must be content_size + this.
CONTENT_TAG_SIZE = 16


def truncate_utf8(text: str, max_bytes: int = MAX_DEVICE_NAME_BYTES) -> str:
    """Cut `text` to at most `max_bytes` of UTF-8 without splitting a character (F-012)."""
    raw = text.encode("utf-8")
    if len(raw) <= max_bytes:
        return text
    return raw[:max_bytes].decode("utf-8", errors="ignore")


def clamp_pull_limit(limit: int, max_limit: int = MAX_PULL_LIMIT,
                     default: int = DEFAULT_PULL_LIMIT) -> int:
    """0 -> default, else min(limit, max) (0k-sync `session.rs:496-505`)."""
    return default if limit == 0 else min(limit, max_limit)


def effective_ttl(ttl: int, default: int = DEFAULT_TTL_SECONDS,
                  maximum: int = MAX_TTL_SECONDS, minimum: int = 0) -> int:
    """0 -> default; longer than the maximum -> the maximum; shorter than the minimum (the
    shell passes its PUSH_ACK wait, so the stream never rejects a row as expired) -> it."""
    return max(minimum, default if ttl == 0 else min(ttl, maximum))
