"""cursor-sync (0k-sync wire, ALPN /0k-sync/1) as a sans-I/O core: `messages` (the codec),
`framing` (u32 BE length ‖ MessagePack, 1 MiB checked before decoding), `session` (what is legal
when), `identity` (the Ed25519 connection challenge and member admissions), `limits` (the
hardening table), `token_bucket` (rate limits). The asyncio shell is `ingress/sync_quic.py`."""

PROTOCOL = "sync"
ALPN = "/0k-sync/1"
