"""Settings for every relay process: defaults here, `conf/relay.toml` over them, env over both.

One dataclass tree is the single source of truth: the comment above a field is its
description, and runtime/settings_doc.py renders from it the reference page
(docs/reference/settings.md) and the header of `conf/relay.toml` (tests keep both equal).
Every setting has an environment variable, `RELAY_<SECTION>__<KEY>` (`env_name`); the
older names of ENV_OVERRIDES still work. Every value is checked (pydantic, over these same
dataclasses) before a role starts: a bad one is a ConfigError, one line.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


@dataclass
class TruesealConf:
    # The push listener (Noise NK, anonymous senders) and the receive listener (Noise XX,
    # devices), spec 001's :7701 and :7700.
    push_port: int = 7701
    receive_port: int = 7700
    # 65,535 - 16 (AEAD tag) - 5 (frame header) - 32 (recipient): the largest envelope that
    # fits one Noise transport message (trueseal-interop §5). A larger value is unreachable.
    max_envelope: int = 65482
    # Hand each landed push to egress at once (runtime/handoff.py), so a receiver that is
    # online has it in milliseconds rather than after the next micro-batch. The stream stays
    # the authority (dedup, cursors, audits); false: delivery waits for the inbox row.
    early_delivery: bool = True
    # Ack only counts once the landing commit returned; this bounds how long a push may wait.
    ttl_seconds: int = 30 * 24 * 3600
    heartbeat_idle_seconds: float = 30.0
    # A session that does not echo a heartbeat within this many seconds is closed.
    heartbeat_timeout_seconds: float = 30.0
    # When the device opens a newer session while this one still holds unacked blobs, probe
    # at once and close if unanswered within this many seconds (the blobs then move on).
    superseded_probe_seconds: float = 5.0
    # Both listeners. The Noise handshake (NK: 2 messages, XX: 3, each under 100 bytes) must be
    # done this long after accept; the real client sends each message as soon as it can.
    handshake_timeout_seconds: float = 10.0
    # Push sessions (NK, anonymous): the next Push must start this long after the handshake
    # or the last reply. The real client sends its one Push right after the handshake, waits
    # for the Ack and closes (interop §6); a session that says nothing holds a slot for free.
    push_idle_timeout_seconds: float = 10.0
    # Both listeners: a Noise message (at most 65,537 bytes with its length) must be complete
    # this long after its first byte, plus its length at `min_frame_bytes_per_second`: a
    # client on a 32 kbit/s link still sends the largest Push in 26 s; a drip does not last.
    frame_timeout_seconds: float = 10.0
    min_frame_bytes_per_second: int = 4096
    # Both listeners: a reply or Deliver the client does not take for this long closes that
    # connection (a device on a 32 kbit/s link takes a 64 KiB Deliver in 16 s).
    write_timeout_seconds: float = 30.0
    # Each listener: connections in all stages together (the public relay's 1,000). Full:
    # the oldest handshake of the address holding the most is closed for the newcomer; with
    # no handshake to close, the newcomer is closed at once, sending nothing (interop §1).
    max_connections: int = 1000
    # Each listener: connections still in the Noise handshake (a real one lasts a round
    # trip). Full: the oldest of the address holding the most is closed for the newcomer.
    max_handshakes: int = 1000
    max_handshakes_per_address: int = 256
    # Push sessions after NK (anonymous). Full: evicted as handshakes are. Kept below
    # max_connections so that idle sessions can never fill it. Per address: the real client
    # opens one connection per blob; 256 covers a busy NAT. An address at its cap loses its
    # session idle longest (no Push since NK, or since its last Ack), never one whose Push is
    # being stored, to the newcomer.
    max_push_sessions: int = 600
    max_push_sessions_per_address: int = 256
    # Receive sessions after XX (any key passes XX, so a proven key protects nothing). The
    # stage full: a newcomer takes the idlest session of the biggest holder only if that is
    # fair (engine/admission.py rule 3), else it is closed after its handshake (the client
    # reconnects with back-off, interop §8). An address at its cap (a carrier NAT's many
    # devices, or one attacker): its session idle longest (no Deliver or DeliverAck, only
    # heartbeats) and holding no unacked Deliver is closed for the newcomer.
    max_receive_sessions: int = 900
    max_receive_sessions_per_address: int = 100
    # Receive sessions of one device key (the XX remote static key) at once. The real client
    # keeps one, and reconnects with back-off from 1 s (interop §8) while the relay may still
    # hold the dead one until its heartbeat goes unanswered (up to 60 s): a few. At the cap
    # its idlest session without unacked Delivers is closed for the new one.
    max_receive_sessions_per_key: int = 4
    listen_backlog: int = 1024   # both listeners (asyncio's default 100 lost bursts)


@dataclass
class IngressConf:
    # This ingress node's name: its landing tables are its own (landing/<node_id>), and two
    # processes may not run under one id, even from a copied data directory
    # (delta_tables/node_claim.py, delta_tables/node_lease.py).
    node_id: str = "node-0"
    # The node's lease in the store (tables_dir): renewed every lease_renew_seconds. A process
    # starting under a node id whose lease is live is refused; a node that could not renew for
    # lease_seconds stops writing, and its id can be taken over. A clean stop releases it.
    lease_seconds: float = 15.0
    lease_renew_seconds: float = 3.0
    # Heya, PPP and cursor-sync may run on several ingress hosts at once; each host folds what
    # the others changed in the protocol's control tables every control_follow_seconds (a
    # stat, or a HEAD on S3, per control table when nothing changed). A token or mailbox made
    # on another host is looked for at once; this bounds how long a revocation there (DEAU,
    # REVOKE, a deregistered delivery token) is still honoured here.
    control_follow_seconds: float = 1.0
    # `relay up` runs one ingress process per protocol (`relay ingress --protocol P`, node id
    # `<node_id>-<P>`): an attack on one listener, or its CPU, cannot stall another's event
    # loop, and the protocols spread over the cores. false: one process runs every listener.
    process_per_protocol: bool = True
    # Group commit: flush as soon as the previous commit returned, with at most this many rows.
    max_rows_per_commit: int = 20000
    # A group of at most this many rows commits on the event loop's own thread, not a worker's:
    # the hop there and back costs ~0.1-0.2 ms of a lone client's ~2 ms ack on this machine.
    # The loop waits for that commit's fsyncs (~1-2 ms; Redis's appendfsync always does the
    # same), and the senders arriving meanwhile form the next, larger group, which commits
    # in a worker thread while the loop reads on. 0: every group goes to a worker thread.
    # Local landing tables only (an object store commit is a network round trip).
    inline_commit_rows: int = 1
    # Rotate to a new landing generation after this many commits: keeps the log short, so commit
    # latency stays flat, and lets compaction drop consumed generations as whole directories.
    commits_per_generation: int = 250
    # ... and once a generation holding rows is this old (also when idle): compaction drops
    # only sealed generations, and each row's envelope is a copy of the inbox's. 0: by count only.
    generation_max_age_seconds: int = 120


@dataclass
class StreamConf:
    # Where the dedup index and cursors live. true: Spark's state store (a JVM
    # transformWithState over RocksDB, checkpointed; jobs/stream_state.py), the checkpoint
    # beside the tables on S3 so that any host can take the stream over, memory bounded
    # however many live event ids. false: the driver's memory (~171 bytes per live id, rebuilt
    # from the inbox at each start), the checkpoint on this host. "auto": true when the tables
    # are on S3 (several hosts, and the scale the state store is for), false on a local disk,
    # where a small batch costs ~25 ms against the state store's ~240 ms (Heya and cursor-sync
    # replies wait for it; docs/operating/stream-state.md). A change of path needs a new
    # checkpoint: on S3 tables it is a new one (s3a://<tables>/_checkpoints/inbox_stream).
    state_store: bool | Literal["auto"] = "auto"
    # At most one micro-batch start per interval (batches run back to back under backlog).
    # A Heya or cursor-sync reply waits on average half of it for its batch to start: at
    # 100 messages/s, 60 ms measured HAVE p50 ~80 ms against ~100 ms at 100, for ~0.25 more
    # cores while such a trickle lasts (README, "The sink commits directly"). Idle costs
    # nothing either way (wait_for_data_ms).
    trigger_interval_ms: int = 60
    # With nothing new, the source waits up to this long for a landing commit's signal
    # (loopback UDP, runtime/inbox_signal.py) instead of being asked again every interval:
    # an idle stream costs almost nothing and a commit starts a batch at once. 0: poll every
    # trigger_interval_ms as Spark's processing-time trigger does.
    wait_for_data_ms: int = 1000
    # Tables on an object store: the stream LISTs the landing prefixes (finding a new ingress
    # node) at most once per this interval. In between it looks for each table's next commit
    # and each node's next generation by reading them (a HEAD each, GET-priced), so an idle
    # stream makes no other LIST (docs/scale-out.md, "Listing the log"). A new node's first
    # landing waits up to this long to be seen. Local tables are listed on every look.
    landing_list_interval_ms: int = 10000
    # When every landing commit waiting is of a protocol whose online recipients ingress already
    # served from the landing commit (PPP STOREs; trueseal pushes with early_delivery), at most
    # one micro-batch start per this interval: their inbox rows (dedup, cursors, audits,
    # offline recipients) follow within it, and a lone sender's trickle stops costing a
    # micro-batch every trigger_interval_ms beside the listeners. A commit that needs the
    # stream (Heya, cursor-sync, PPP rooms) ends it within trigger_interval_ms. <= the trigger
    # interval: off.
    early_batch_gap_ms: int = 500
    # Bound a micro-batch, which passes through driver memory (DESIGN.md): a batch grows under
    # a backlog up to either bound (one commit is never split). The byte bound keeps it on the
    # driver's read path (driver_read_max_bytes): a 200k-row batch read by the executors took
    # 2.0 s on local[2], the same rows as two batches read by the driver 0.8 s.
    # max_bytes_per_trigger = 0: no byte bound.
    max_files_per_trigger: int = 2000
    max_bytes_per_trigger: int = 64 << 20
    max_partitions: int = 4
    # A micro-batch up to this many bytes of landing files is read by the driver straight from
    # the files its offsets name (low latency); a larger one by the executors, in parallel.
    driver_read_max_bytes: int = 64 << 20
    checkpoint_dir: str = ""  # default: <data_dir>/checkpoints/inbox_stream
    max_ttl_seconds: int = 30 * 24 * 3600
    padding_buckets: list[int] = field(default_factory=lambda: [256, 1024, 4096, 16384])
    # Known fixed overhead per protocol added on top of a padded plaintext (bytes).
    padding_overhead: dict[str, int] = field(
        default_factory=lambda: {"trueseal": 0, "ppp": 130, "ppp_room": 40})
    # Cursors start at 1 unless a protocol says otherwise (Heya sequence numbers start at 0).
    cursor_start: dict[str, int] = field(default_factory=lambda: {"heya": 0})
    app_id: str = "relay-inbox-stream"
    master: str = "local[2]"
    # Appended to the driver JVM's options (`spark.driver.extraJavaOptions`) of the stream
    # and of `relay bench`: how the JVM spends memory and CPU while the relay idles.
    jvm_options: str = ""
    # More Spark settings for the stream's session (`[stream.spark_conf]`, strings).
    spark_conf: dict[str, str] = field(default_factory=dict)


@dataclass
class EgressConf:
    # Per mailbox, at most this many envelopes are held in memory; the rest stay in Delta and
    # are paged in as the held ones are acked.
    max_pending_per_mailbox: int = 1000
    # The stream tells every process that follows the inbox of each commit over loopback UDP
    # (runtime/inbox_signal.py); they also poll the inbox log this often, for a signal that
    # was lost or a stream on another host (false: polling only: set the interval to ~50).
    inbox_signal: bool = True
    poll_interval_ms: int = 1000
    ack_max_rows_per_commit: int = 20000


@dataclass
class CompactionConf:
    # An acknowledged or expired envelope's bytes are gone from every file of the tables this
    # long after its ack or expiry at the latest (docs/operating/retention.md). The schedule
    # below must fit it: ack_grace_seconds + 2 x interval_seconds + vacuum_retention_seconds
    # may not exceed it (a run's own time is the rest).
    delivered_bound_seconds: int = 600
    # `relay compact --loop` (and `relay up`) runs a compaction this often.
    interval_seconds: int = 120
    # Acked envelopes stay this long before deletion (a late duplicate DeliverAck is harmless).
    ack_grace_seconds: int = 60
    # How long a file compaction removed (delivered ciphertext) stays on disk for readers
    # that hold an older snapshot; they recover when one goes. 0 removes them at once.
    vacuum_retention_seconds: int = 120
    target_file_mb: int = 64
    # `rejects` (why the stream turned an envelope away: its size, never its bytes) and
    # `padding_audit` (how traffic sits in the padding buckets) rows are deleted once this
    # old. They are for operators looking into a client's complaint and for capacity
    # reviews, which a week covers; kept for ever they grow with traffic and take the
    # storage ratio past 2x on a relay that runs for weeks.
    audit_retention_days: float = 7.0


@dataclass
class MetricsConf:
    # Prometheus `/metrics` of each long-running process, on its own port (0: not served).
    # Loopback by default whatever `bind` says: the endpoint is for the operator's scraper.
    bind: str = "127.0.0.1"
    ingress_port: int = 9701        # `relay ingress` with every listener, or trueseal push alone
    egress_port: int = 9702
    stream_port: int = 9703
    compact_port: int = 9704
    ingress_heya_port: int = 9705   # `relay ingress --protocol heya` (one process per protocol)
    ingress_ppp_port: int = 9706
    ingress_sync_port: int = 9707
    push_port: int = 9708

    def port(self, role: str) -> int:
        """`role` as the process names itself: ingress, ingress-heya, egress, ..."""
        if role == "ingress-trueseal":
            return self.ingress_port
        return getattr(self, f"{role.replace('-', '_')}_port")


@dataclass
class HeyaConf:
    # The Heya listener, in the ingress process. Any number of ingress hosts may run it at
    # once over one set of tables: they share its control tables (decision 0010).
    enabled: bool = True
    port: int = 8337
    # Server certificate and key (PEM). Empty: <data_dir>/keys/heya_server.{crt,key},
    # created on first start.
    cert_file: str = ""
    key_file: str = ""
    # Largest SEND body; a longer SEND closes the connection before its body is read (the
    # public server has no cap and preallocates whatever length it is told, interop §5.3).
    max_body: int = 1048576
    ttl_seconds: int = 30 * 24 * 3600
    handshake_timeout_seconds: float = 10.0
    # No new command for this long: close (the public server stops reading after 30 s; its
    # client pings every 5 s).
    idle_timeout_seconds: float = 30.0
    # A command must be complete this long after its first byte, plus its body at this rate.
    command_timeout_seconds: float = 10.0
    min_body_bytes_per_second: int = 65536
    # A reply that cannot be written for this long closes that connection only.
    write_timeout_seconds: float = 10.0
    # A session whose certificate is neither a mailbox nor has sent with a valid send token
    # (UNAUTH) is closed this long after its TLS handshake: the reference client runs INCO or
    # SEND at once after the greeting; nothing else a stranger may do needs a session.
    unauth_timeout_seconds: float = 60.0
    # Connections in all stages together. Full: the oldest TLS handshake of the address
    # holding the most is closed for the newcomer; with none, the newcomer is closed at once.
    max_connections: int = 1500
    # Connections in their TLS handshake (one round trip for a real client; each costs
    # ~55 KiB mid-handshake: 500 of them ~27 MiB). Full: evict as above.
    max_handshakes: int = 500
    max_handshakes_per_address: int = 64
    # UNAUTH sessions. Full: the idlest of the address holding the most is closed for the
    # newcomer. Per address: a PING every 25 s kept 1,000 of them from one address before.
    max_unauth_sessions: int = 300
    max_unauth_sessions_per_address: int = 32
    # AUTH sessions: the certificate is a mailbox (at the greeting or on INCO) or sent with a
    # valid send token. Full, a promotion takes the idlest session of the biggest holder only
    # if that is fair (engine/admission.py rule 3), else the session stays UNAUTH (served,
    # but evictable and under unauth_timeout_seconds). Per address: a household's or an
    # office's devices. An address at its UNAUTH or AUTH cap loses its session idle longest
    # (no command but PING, no HAVE) and not mid-delivery (a SEND being stored, a reply
    # owed) to the newcomer, so a neighbour's idle sessions never lock a NAT's users out.
    max_auth_sessions: int = 1000
    max_auth_sessions_per_address: int = 64
    # Sessions of one client certificate (its SHA-256 digest) at once, all stages. The
    # reference client holds one connection (mailbox and sender alike) and reconnects when
    # it drops, while the server may still hold the dead one until idle_timeout_seconds: a
    # few. Any self-signed certificate passes (interop §1), so this only stops one identity
    # from taking an address's share; at the cap its idlest session goes for the new one.
    max_sessions_per_certificate: int = 4
    listen_backlog: int = 1024   # asyncio's default 100 lost bursts of connects
    max_in_flight: int = 64                # SENDs of one connection being stored at once
    max_in_flight_bytes: int = 67108864    # bodies being stored, all connections together
    cache_bytes: int = 67108864            # recent bodies kept in memory for WANT


@dataclass
class PppConf:
    # PPP over WebSocket (/v1/ws), sealed-sender and polling HTTP, hosted by the ingress
    # process (FastAPI + uvicorn); the limits themselves are appendix C's (engine/ppp).
    enabled: bool = True
    port: int = 8780
    # NOTIFY batching (§8 "batch windows", default 30 s): new events of one recipient are
    # counted for this long, then one NOTIFY(count) goes out. Breaks store->notify timing
    # correlation; 0 notifies at once.
    notify_window_ms: int = 30000
    # No AUTH_OK this long after the WebSocket opened: closed. The real client (relay/
    # ppp_client.py) answers the CHALLENGE at once: one round trip.
    handshake_timeout_seconds: float = 10.0
    # Largest WebSocket message / polling body: a 5 MiB STORE_BACKUP plus MessagePack framing
    # (uvicorn's default, 1 MiB, would refuse a legitimate backup).
    max_message_bytes: int = 5767168
    # HTTP polling: a signed timestamp may be this far from now; each signature is used once.
    http_auth_window_seconds: int = 300
    # A polling GET's signature covers `GET <path?query>` || timestamp (engine/ppp/protocol.py
    # http_get_signed_body), so a captured one cannot read another path. False: the spec's
    # literal body || timestamp, i.e. the timestamp alone, for clients that sign only that.
    http_get_signature_covers_path: bool = True
    # Proxies whose X-Forwarded-For is believed (comma-separated addresses or CIDRs; env
    # PPP_TRUSTED_PROXIES, spec §5.x), by the sealed endpoints' per-IP budget and by the
    # connection budgets below once a request head is in. Default: loopback.
    trusted_proxies: str = "127.0.0.0/8,::1"
    # TLS on the PPP listener itself (wss:// and https://): a PEM certificate chain and its
    # key, both or neither. Empty: plain ws/http, for a TLS-terminating proxy in front (set
    # trusted_proxies to it); docs/clients/ppp-client.md shows both.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    max_in_flight: int = 64      # commands of one WebSocket being carried out at once
    # WebSockets open at once; past it the upgrade is answered 403. The budgets below bind
    # first (a WebSocket is UNAUTH, then AUTH).
    max_connections: int = 14000
    # Envelope bytes of pending events held in memory for FETCH; the rest is read back from
    # the inbox (an offline recipient's backlog costs disk, not RAM).
    cache_bytes: int = 268435456
    # Room messages (§7) held in memory for FETCH_ROOM; the rest is read from the inbox.
    room_cache_bytes: int = 67108864
    # ROOM_STORED carries the stream's sequence number: the longest STORE_ROOM waits for
    # the inbox commit that assigns it before answering STORE_FAIL "sequence pending" (the
    # message is durable; a retry of the same bytes gets its number).
    room_sequence_timeout_seconds: float = 10.0
    # KICK_MEMBER / BAN_MEMBER (§7.7): off answers STORE_FAIL "feature disabled", as the
    # spec's shipped builds do; on, the room admin may kick and ban.
    moderation: bool = False
    # Contact discovery (§9): the pepper rotates on this schedule; a client re-publishes its
    # hashes under each new pepper (engine/ppp/discovery.py).
    discovery_pepper_rotation_hours: float = 168.0
    # The pepper seed (32 bytes, hex): empty is <data_dir>/keys/discovery_pepper.key, created
    # on first start. PPP on several hosts: give every host the same file, or a PUBLISH on one
    # host matches no QUERY on another (each would pepper with its own seed).
    discovery_pepper_seed_file: str = ""
    # --- hostile clients ---
    # The request head must be complete this long after accept (and after the previous
    # response): the websockets client, browsers and http.client send the whole head in one
    # write right after connect; a head sent a byte at a time (5 s apart) held a slot for ever.
    request_head_timeout_seconds: float = 10.0
    # A request body, a WebSocket frame (or message in fragments) and output the client does
    # not take must move at min_bytes_per_second once this long has passed since it began:
    # a 5 MiB backup at 32 kbit/s still goes through; a body shorter than its Content-Length,
    # a half-sent frame or a client that stops reading is closed instead of waiting for it.
    request_body_timeout_seconds: float = 10.0
    frame_timeout_seconds: float = 10.0
    write_timeout_seconds: float = 30.0
    min_bytes_per_second: int = 4096
    # Idle between two HTTP requests on one connection (uvicorn's timeout_keep_alive and its
    # default): a polling client coming back later opens a new connection.
    keep_alive_timeout_seconds: float = 5.0
    # Idle WebSockets: a ping every interval; no pong within the timeout closes it. The
    # websockets client answers pings by itself, and the relay sends NOTIFYs, so only a dead
    # peer (or one that stopped reading) misses 40 s.
    ws_ping_interval_seconds: float = 20.0
    ws_ping_timeout_seconds: float = 20.0
    # The first WebSocket message is the AUTH (about 120 bytes): one announcing more is
    # closed before it is buffered (a stranger's memory is bounded).
    max_unauth_message_bytes: int = 4096
    # A request head larger than this is refused with 400 (h11's default; real heads: <1 KiB).
    max_request_head_bytes: int = 16384
    # Listen backlog (somaxconn caps it; 4096 here): a burst of 2,000 connects waits in it.
    listen_backlog: int = 2048
    # Connection budgets (engine/admission.py), counted from TCP accept. All stages together:
    # within the descriptors the process has (the other listeners and process.
    # open_files_reserve take theirs; near the limit accepting pauses anyway).
    max_sockets: int = 14000
    # Accepted, no complete request head. A real one lasts a round trip. Full: the oldest of
    # the address holding the most is closed for the newcomer.
    max_handshakes: int = 2000
    max_handshakes_per_address: int = 128
    # An HTTP request (or keep-alive between requests: anonymous or signed per request, an
    # HTTP connection never authenticates) or a WebSocket before AUTH_OK. Full: evicted as
    # handshakes are.
    max_unauth_connections: int = 2500
    max_unauth_connections_per_address: int = 256
    # WebSockets after AUTH_OK: never evicted; full (or the address at its cap), the AUTH gets
    # AUTH_FAIL "relay full" and close 1013 (the client retries with back-off). An idle one
    # costs ~36 KiB of heap. Per address: a carrier-grade NAT or an office puts many phones
    # behind one IPv4 address (IPv6 counts per /64). unauth + auth stay below max_sockets, so
    # established sessions can never fill the house.
    max_auth_sessions: int = 11000
    max_auth_sessions_per_address: int = 256
    # WebSockets after AUTH_OK of one pubkey at once. The reference client keeps one socket
    # per identity (appendix C: FETCH and STORE are rate-limited per key, so more buy it
    # nothing) and reconnects when it drops, while the relay may still hold the dead one
    # until its pings go unanswered (40 s): a few. At the cap, and at an address's cap, the
    # session idle longest (no command, no NOTIFY or delivery: pings do not count) and not
    # mid-delivery (a NOTIFY or FETCH page not yet written, a STORE not yet answered) is
    # closed for the newcomer, whatever the key that proved it (any key passes AUTH).
    max_sessions_per_pubkey: int = 4


@dataclass
class SyncConf:
    # The cursor-sync relay over QUIC (ALPN /0k-sync/1), hosted by the ingress process; any
    # number of ingress hosts may run it at once (decision 0010). Limits: engine/sync/limits.
    enabled: bool = True
    port: int = 4433
    # Server certificate and key (PEM). Empty: <data_dir>/keys/sync_server.{crt,key}, created
    # on first start; clients pin its SHA-256 (`relay keys`).
    cert_file: str = ""
    key_file: str = ""
    # 0k-sync semantics: anyone who knows a group id joins it. Off: a member must admit you.
    open_groups: bool = False
    # The iroh endpoint for stock 0k-sync clients (ingress/sync_iroh.py): same wire and
    # state, the device id from iroh's raw-key TLS. Its secret key: `iroh_key_file`, or
    # <data_dir>/keys/sync_iroh.key created on first start (the endpoint id survives restarts).
    iroh_enabled: bool = True
    iroh_port: int = 4434                    # UDP
    iroh_key_file: str = ""
    # iroh's public relay servers and DNS discovery (n0 preset): clients behind NATs may then
    # dial by endpoint id alone. Off: direct addresses only (loopback, LAN, a public IP).
    iroh_discovery: bool = False
    max_message_size: int = 1048576          # ST-001: frame cap, checked before decoding
    # Hostile clients (stages: HANDSHAKE = QUIC handshake under way, UNAUTH = before
    # HELLO is accepted, AUTH = after). A QUIC handshake is one round trip (two with a Retry)
    # and lost flights are resent with back-off from ~1 s (aioquic, quinn): done this long
    # after the first Initial, or dropped without a word (0k-sync's client gives up at 30 s).
    handshake_timeout_seconds: float = 10.0
    # ... and dropped sooner once its client sent nothing for this long: a live client resends
    # its flight on its own timer (RFC 9002: ~1 s, then 2 s), one that left never will
    # (quic-go's defaults: 5 s without a packet, 10 s in all).
    handshake_idle_timeout_seconds: float = 5.0
    hello_timeout_seconds: float = 10.0      # F-006: auth + HELLO within this (code 3)
    # A request stream must deliver its whole frame this long after its first byte (0k-sync
    # waits for ever; its client writes a request in one go).
    stream_read_timeout_seconds: float = 10.0
    idle_timeout_seconds: float = 60.0       # QUIC idle timeout
    # F-007 (0k-sync's 10,000): connections past their handshake (UNAUTH + AUTH together),
    # and AUTH alone; a connection that would pass it is closed with code 2 "too many
    # sessions". Per address, AUTH: 0k-sync holds one connection per device (its CLI one per
    # command), so a household's or an office's devices behind one NAT.
    max_concurrent_sessions: int = 10000
    max_sessions_per_address: int = 100
    # AUTH sessions of one device id at once (code 2 "too many sessions" past it, only when
    # every one of them is mid-delivery). 0k-sync holds one connection per device (its CLI
    # one per command) and reconnects after a drop while the relay may still hold the old
    # one until its idle timeout: a few. At this cap, and at an address's, the session idle
    # longest (no request, no NOTIFY: QUIC keep-alive PINGs do not count) and not
    # mid-delivery (a request being answered, a NOTIFY being written) is closed (code 2).
    max_sessions_per_device: int = 4
    # UNAUTH lasts a round trip or two for a real client (the identity challenge, then Join /
    # HELLO at once). Full: the oldest of the address holding the most is closed (code 2) for
    # the newcomer; an address at its cap: the newcomer is (code 2). Kept well below
    # max_concurrent_sessions, so unauthenticated connections can never fill that.
    max_unauth_sessions: int = 1000
    max_unauth_sessions_per_address: int = 32
    # Connections in their QUIC handshake: each holds ~100 KiB (aioquic 1.7, measured), so
    # 500 are ~50 MiB. Full: the oldest of the address holding the most is dropped for the
    # newcomer; an address at its cap: its new Initials are dropped unanswered.
    max_handshakes: int = 500
    max_handshakes_per_address: int = 32
    # Address validation: while this many connections are in handshake (0: always), or this
    # many of one address, a new connection must first echo a stateless Retry (one more
    # round trip). 0k-sync clients hold one long-lived connection each, so a few handshakes
    # at a time is normal; a flood of spoofed sources then holds at most these.
    retry_above_handshakes: int = 100
    retry_above_handshakes_per_address: int = 8
    # Request streams a client may have open at once (aioquic's default: 128). Before HELLO
    # the identity exchange, a Join and HELLO are all it needs. After, 0k-sync sends one
    # request at a time; a client that pipelines PUSHes gets one PUSH_ACK per stream per
    # landing commit (~20-80 ms), so 16 streams carry a few hundred PUSH/s on one
    # connection (4 held one at 50/s to a queue of seconds in `relay bench`). The cost: up
    # to 16 x one largest frame buffered per authenticated connection.
    max_streams_before_hello: int = 4
    max_streams_per_connection: int = 16
    # A request stream's receive window before HELLO is accepted (after: one largest frame):
    # the identity exchange, a Join and a HELLO (a 256-character name) fit many times over.
    stream_window_before_hello: int = 16384
    # The UDP socket's receive buffer (SO_RCVBUF; Linux caps it at net.core.rmem_max): what
    # arrives while one event-loop turn runs waits here. The endpoint drains it every turn
    # (runtime/udp_endpoint.py), so a flood of Initials no longer sits in it ahead of the
    # sessions' packets (with asyncio's one datagram per turn, 4 MiB of queued Initials held
    # a session's PUSH 3.8 s; 512 KiB dropped its packets instead).
    receive_buffer_bytes: int = 4194304
    # New connections' Initials read but not yet started (~1 ms of CPU each, 8 per turn,
    # after the sessions' packets), served one source address at a time in turn; full: the
    # oldest of the address queueing most is dropped (its client resends). Per address: a
    # real client opens one connection (a NAT of many, a few at a time).
    initial_queue: int = 512
    initial_queue_per_address: int = 16
    # New connections (full QUIC handshakes, ~8 ms of CPU each with auth and HELLO) one source
    # address may start per second (a burst of this many, then this many a second); past it
    # an Initial is dropped unanswered and the client resends. A 0k-sync device opens at most
    # 10 a minute; this leaves room for a NAT of hundreds of devices, while a flood from one
    # address, which completed ~95 handshakes a second, costs a fifth of that.
    handshakes_per_address_per_second: int = 20
    # The share of a core that connections before their HELLO (starting them, their
    # handshake packets and timers: ~8 ms of CPU a connection here) may take, measured, before
    # an address not known lately (no session authenticated from it in 10 minutes) waits to
    # start another (a burst of 0.25 s of CPU at once); its Initials wait in `initial_queue`
    # (the oldest dropped, the client resends). A flood from 253 addresses passes every
    # per-address limit and took ~90% of the listener's core; known addresses' new
    # connections never wait. The cost: ~40 unknown newcomers a second on a relay under it.
    new_connection_cpu_share: float = 0.3
    connections_per_minute: int = 10         # per device id; past it, close code 1
    messages_per_minute: int = 100           # per device, PUSH + PULL (burst = the count)
    control_requests_per_minute: int = 60    # per device, our extension requests (burst = it)
    global_requests_per_second: int = 1000   # SR-001: PUSH + PULL of everyone
    max_pull_limit: int = 1000               # F-013
    default_pull_limit: int = 100            # a PULL with limit 0
    cursor_gap_cap: int = 10000              # F-019: one PULL spans at most this many cursors
    max_device_name_bytes: int = 256         # F-012: cut on a UTF-8 boundary
    default_ttl_seconds: int = 604800        # PUSH ttl 0
    max_ttl_seconds: int = 2592000           # longer TTLs are clamped
    max_group_storage: int = 104857600       # payload bytes per group
    max_blob_size: int = 1048576
    max_push_token_bytes: int = 4096
    push_ack_timeout_seconds: float = 30.0   # PUSH_ACK waits this long for the inbox commit
    cache_bytes: int = 268435456             # payloads held in memory for PULL


@dataclass
class ApnsConf:
    # Token (ES256 JWT) auth: the .p8 signing key from Apple's developer account, its key id,
    # the team id, and the app's bundle id (apns-topic). Env: RELAY_APNS_KEY_FILE, ...
    key_file: str = ""
    key_id: str = ""
    team_id: str = ""
    topic: str = ""
    url: str = "https://api.push.apple.com"    # sandbox: https://api.sandbox.push.apple.com
    ca_file: str = ""                           # a private CA to trust (tests); "" = system


@dataclass
class FcmConf:
    # FCM HTTP v1: a Google service-account JSON file (its token_uri is where OAuth2 tokens
    # come from). Env: RELAY_FCM_SERVICE_ACCOUNT_FILE.
    service_account_file: str = ""
    url: str = "https://fcm.googleapis.com"
    # A private CA to trust (PEM) for the FCM API and the OAuth2 token endpoint; "" = system.
    ca_file: str = ""


@dataclass
class WebPushConf:
    # VAPID (RFC 8292): the relay's P-256 private key (PEM or raw base64url; created under
    # <data>/keys/ when empty) and the contact the push services may reach ("mailto:...").
    vapid_private_key_file: str = ""
    vapid_subject: str = ""
    # Subscription endpoints on loopback or private addresses are refused unless true (the
    # relay would otherwise POST wherever a client points it).
    allow_private_endpoints: bool = False
    # A private CA to trust (PEM) for subscription endpoints; "" = system.
    ca_file: str = ""


@dataclass
class PushConf:
    # The push job (`relay push`, started by `relay up`): wakes offline devices whose owner
    # has a registered push token. A platform with no credentials is recorded as `dry_run`
    # in push_log, and the job says so at start.
    enabled: bool = True
    # At most one wake-up per device per window (spec 004's batching window, 30 s).
    window_seconds: float = 30.0
    # Retries of a 429 / 5xx / network error: up to this many attempts, full-jitter backoff
    # from retry_base_ms doubling to retry_max_ms (or the provider's Retry-After).
    max_attempts: int = 5
    retry_base_ms: int = 500
    retry_max_ms: int = 30000
    request_timeout_seconds: float = 10.0
    max_in_flight: int = 64      # provider requests at once
    # push_log rows (two per wake-up) are kept this long by `relay compact`.
    log_retention_days: float = 30.0
    apns: ApnsConf = field(default_factory=ApnsConf)
    fcm: FcmConf = field(default_factory=FcmConf)
    webpush: WebPushConf = field(default_factory=WebPushConf)


@dataclass
class ProcessConf:
    # Descriptors the TCP listeners of a process leave free for Delta commits, logs and
    # /metrics: past the limit minus this, they stop accepting until descriptors free up.
    # (Each process raises its soft RLIMIT_NOFILE to the hard limit at start.)
    open_files_reserve: int = 256
    # `relay up` forks its Python roles from one process that imported their modules once
    # (relay/zygote.py): they share those pages (idle: 1,128 -> 994 MiB PSS for the whole
    # relay, `relay bench --startup`; the stream too since: README).
    # false: each is spawned fresh and imports for itself.
    fork_roles: bool = True


@dataclass
class ClusterConf:
    # The peer channel between hosts (docs/operating/peer-channel.md): ingress hands each
    # landed trueseal push (egress) and PPP STORE (PPP listeners) to the hosts where its
    # recipient is online, and the stream's inbox wake-up to PPP, Heya and cursor-sync
    # listeners on other hosts, over Noise IK with each host's own key
    # (<data_dir>/keys/peer_static.key), so a recipient connected to any host gets it in
    # milliseconds rather than after a micro-batch or a poll. Off by default: one host needs
    # none (its Unix socket hand-off stays), and no port is opened unless asked.
    # true: an ingress process (trueseal push, PPP, Heya, cursor-sync) listens for peers on
    # peer_bind:peer_port and lists its key, endpoint and protocols in the store
    # (tables_dir/_relay/peers) while its lease is live.
    peer_listen: bool = False
    # Empty: the address in `bind`. 0 for the port: any free port (what is bound is listed).
    peer_bind: str = ""
    peer_port: int = 7702
    # The host other hosts dial (empty: the bound address; set it when binding 0.0.0.0).
    peer_advertise: str = ""
    # true: egress dials every live trueseal ingress that listens, subscribing the trueseal
    # mailboxes that have a session on it; a PPP, Heya or cursor-sync listener dials the
    # same protocol's listeners on other hosts (PPP: its online recipients; all: the
    # stream's wake-ups). A process that does not listen lists its own key.
    peer_dial: bool = False
    # How often the peer list is read from the store (new hosts dialled, expired ones
    # dropped) and this process's registration renewed; it expires after
    # ingress.lease_seconds without renewal, like the node lease.
    peer_refresh_seconds: float = 2.0
    # Bytes that may wait for one slow peer before hand-offs to it are dropped (its
    # receivers then get those envelopes from the inbox, a micro-batch later).
    peer_send_buffer_bytes: int = 4194304


@dataclass
class ObjectStoreConf:
    # An S3-compatible store for `tables_dir = "s3://bucket/prefix"`. Empty endpoint: AWS's
    # own. Credentials only from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    # AWS_SESSION_TOKEN), never from this file; commits use conditional put
    # (delta_tables/object_store.py).
    endpoint: str = ""
    region: str = "us-east-1"


@dataclass
class Settings:
    # This host's own files: keys, node tokens, sockets, the stream's checkpoint and (unless
    # tables_dir says otherwise) the Delta tables.
    data_dir: str = "./data"
    # Where the Delta tables are: empty = <data_dir>/tables on this machine, or s3://bucket/prefix
    # shared by ingress, stream, egress and compaction on many hosts. data_dir stays
    # local to each host: keys, node tokens, sockets, the stream's Spark checkpoint.
    tables_dir: str = ""
    # The address every protocol listener binds (0.0.0.0: all of this host's IPv4 addresses).
    bind: str = "127.0.0.1"
    trueseal: TruesealConf = field(default_factory=TruesealConf)
    ingress: IngressConf = field(default_factory=IngressConf)
    stream: StreamConf = field(default_factory=StreamConf)
    egress: EgressConf = field(default_factory=EgressConf)
    compaction: CompactionConf = field(default_factory=CompactionConf)
    heya: HeyaConf = field(default_factory=HeyaConf)
    ppp: PppConf = field(default_factory=PppConf)
    sync: SyncConf = field(default_factory=SyncConf)
    metrics: MetricsConf = field(default_factory=MetricsConf)
    push: PushConf = field(default_factory=PushConf)
    process: ProcessConf = field(default_factory=ProcessConf)
    object_store: ObjectStoreConf = field(default_factory=ObjectStoreConf)
    cluster: ClusterConf = field(default_factory=ClusterConf)

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir).resolve()

    @property
    def tables_on_s3(self) -> bool:
        """`tables_dir` is an S3 location (`s3://bucket/prefix`), shared by every host."""
        return bool(self.tables_dir) and self.tables_dir.startswith("s3://")

    @property
    def stream_state_in_spark(self) -> bool:
        """`stream.state_store` resolved: "auto" is true with the tables on S3."""
        if self.stream.state_store == "auto":
            return self.tables_on_s3
        return bool(self.stream.state_store)

    @property
    def stream_checkpoint(self) -> Path | str:
        """`stream.checkpoint_dir`, else with the state in Spark (`stream_state_in_spark`) and
        the tables on S3 beside them, `s3a://<tables>/_checkpoints/inbox_stream` (a stream
        started on any host takes over from it), else `<data>/checkpoints/inbox_stream`."""
        if self.stream.checkpoint_dir:
            return self.stream.checkpoint_dir if "://" in self.stream.checkpoint_dir \
                else Path(self.stream.checkpoint_dir)
        if self.stream_state_in_spark and self.tables_on_s3:
            return "s3a://" + self.tables_dir[len("s3://"):].rstrip("/") + \
                "/_checkpoints/inbox_stream"
        return self.data_path / "checkpoints" / "inbox_stream"


INGRESS_PROTOCOLS = ("trueseal", "heya", "ppp", "sync")   # `relay ingress --protocol P`


def ingress_protocols(settings: Settings) -> list[str]:
    """The protocols this relay's ingress serves: trueseal push always, the rest if enabled."""
    return ["trueseal"] + [p for p in INGRESS_PROTOCOLS[1:] if getattr(settings, p).enabled]


def ingress_role(protocol: str | None) -> str:
    """How an ingress process names itself (logs, ready line, /metrics): ingress[-<P>]."""
    return "ingress" if protocol is None else f"ingress-{protocol}"


def process_roles(settings: Settings) -> list[str]:
    """The long-running processes `relay up` starts, by role name, in data-flow order."""
    ingress = ([ingress_role(p) for p in ingress_protocols(settings)]
               if settings.ingress.process_per_protocol else ["ingress"])
    return ingress + ["stream", "egress"] + (["push"] if settings.push.enabled else []) + [
        "compact"]


ENV_PREFIX = "RELAY_"


def env_name(dotted: str) -> str:
    """The environment variable of a setting: `RELAY_` and its dotted name upper-cased with
    `__` between the parts (`push.fcm.ca_file` -> `RELAY_PUSH__FCM__CA_FILE`)."""
    return ENV_PREFIX + dotted.upper().replace(".", "__")


# Older names, kept working beside the rule (`env_name`); each maps to a dotted setting.
ENV_OVERRIDES = {
    "RELAY_S3_ENDPOINT": "object_store.endpoint",
    "RELAY_S3_REGION": "object_store.region",
    "RELAY_TRUESEAL_PUSH_PORT": "trueseal.push_port",
    "RELAY_TRUESEAL_RECEIVE_PORT": "trueseal.receive_port",
    "RELAY_TRUESEAL_MAX_ENVELOPE": "trueseal.max_envelope",
    "RELAY_NODE_ID": "ingress.node_id",
    "RELAY_SPARK_MASTER": "stream.master",
    "RELAY_TRIGGER_INTERVAL_MS": "stream.trigger_interval_ms",
    "RELAY_HEYA_PORT": "heya.port",
    "RELAY_PPP_PORT": "ppp.port",
    "PPP_TRUSTED_PROXIES": "ppp.trusted_proxies",   # spec 004 §5.x names this variable
    "RELAY_PPP_TLS_CERT_FILE": "ppp.tls_cert_file",
    "RELAY_PPP_TLS_KEY_FILE": "ppp.tls_key_file",
    "RELAY_SYNC_PORT": "sync.port",
    "RELAY_SYNC_IROH_PORT": "sync.iroh_port",
    "RELAY_METRICS_BIND": "metrics.bind",
    "RELAY_METRICS_PORT_INGRESS": "metrics.ingress_port",
    "RELAY_METRICS_PORT_INGRESS_HEYA": "metrics.ingress_heya_port",
    "RELAY_METRICS_PORT_INGRESS_PPP": "metrics.ingress_ppp_port",
    "RELAY_METRICS_PORT_INGRESS_SYNC": "metrics.ingress_sync_port",
    "RELAY_METRICS_PORT_EGRESS": "metrics.egress_port",
    "RELAY_METRICS_PORT_STREAM": "metrics.stream_port",
    "RELAY_METRICS_PORT_COMPACT": "metrics.compact_port",
    "RELAY_METRICS_PORT_PUSH": "metrics.push_port",
    "RELAY_APNS_KEY_FILE": "push.apns.key_file",
    "RELAY_APNS_KEY_ID": "push.apns.key_id",
    "RELAY_APNS_TEAM_ID": "push.apns.team_id",
    "RELAY_APNS_TOPIC": "push.apns.topic",
    "RELAY_APNS_URL": "push.apns.url",
    "RELAY_FCM_SERVICE_ACCOUNT_FILE": "push.fcm.service_account_file",
    "RELAY_FCM_URL": "push.fcm.url",
    "RELAY_VAPID_PRIVATE_KEY_FILE": "push.webpush.vapid_private_key_file",
    "RELAY_VAPID_SUBJECT": "push.webpush.vapid_subject",
}
# Variables of the relay that are not settings of the tree: the conf file itself, and logs.
ENV_OTHER = {
    "RELAY_CONF": "the settings file (default: conf/relay.toml in the working directory if it "
                  "exists); `relay --conf` overrides it",
    "RELAY_LOG_FORMAT": "auto (default: text on a terminal, else json) | json | text; "
                        "`relay --log-format` overrides it",
    "RELAY_LOG_LEVEL": "debug | info (default) | warning | error; debug adds tracebacks; "
                       "`relay --log-level` overrides it",
    "RELAY_LOG_LIBRARIES": "all: libraries that log per connection (uvicorn, websockets, "
                           "aioquic, asyncio, py4j, h2) log at RELAY_LOG_LEVEL too, through "
                           "the same redaction; default: they log warnings only",
    "NO_COLOR": "set and not empty: no colour in text log lines (no-color.org)",
    "AWS_ACCESS_KEY_ID": "object store credentials (with AWS_SECRET_ACCESS_KEY, "
                         "AWS_SESSION_TOKEN); never read from the settings file",
}


# Settings that once existed: a conf file that still names one loads, with a warning.
RETIRED = {
    "ingress.refresh_handle_every": "landing commits no longer hold a delta-rs handle "
                                    "(delta_tables/direct_append.py)",
}


class ConfigError(ValueError):
    """A setting that cannot be used: its message is one line naming the setting, the value,
    where it came from and what is allowed. `relay` prints it and exits with status 2."""


def leaves(obj: Any = None, where: str = ""):
    """(dotted name, dataclass field, owning class) of every setting, in definition order."""
    cls = Settings if obj is None else obj
    for f in dataclasses.fields(cls):
        default = (f.default_factory() if f.default is dataclasses.MISSING
                   else f.default)
        if dataclasses.is_dataclass(default):
            yield from leaves(type(default), f"{where}{f.name}.")
        else:
            yield f"{where}{f.name}", f, cls


def _set_leaf(data: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        data = data[p]
    data[leaf] = value


def _merge(data: dict, new: dict, where: str, sources: dict, source: str) -> None:
    """The TOML file's values over the defaults (`data`, a dict tree): unknown names refused,
    retired ones warned about."""
    for key, value in new.items():
        dotted = f"{where}{key}"
        if dotted in RETIRED:
            logging.getLogger("relay.config").warning(
                "setting %s is retired and ignored: %s", dotted, RETIRED[dotted])
            continue
        if key not in data:
            raise ConfigError(f"unknown setting {dotted} in {source}")
        if isinstance(data[key], dict) and dotted not in _MAPS:
            if not isinstance(value, dict):
                raise ConfigError(f"setting {dotted} = {value!r} (from {source}): must be a "
                                  f"[{dotted}] table")
            _merge(data[key], value, f"{dotted}.", sources, source)
        else:
            data[key] = value
            sources[dotted] = source


# dict-valued settings (not sections) and list-valued ones, filled at import
_MAPS: set[str] = set()
_LISTS: set[str] = set()


def _from_text(dotted: str, text: str, source: str) -> Any:
    """An environment value: lists and tables as JSON; anything else as text for the
    validator to read (`"8080"`, `"true"`)."""
    if dotted in _MAPS or dotted in _LISTS:
        try:
            return json.loads(text)
        except ValueError:
            raise ConfigError(f"setting {dotted} = {text!r} (from {source}): must be JSON, e.g. "
                              f"{json.dumps(_default(dotted))}") from None
    return text


def _default(dotted: str) -> Any:
    obj: Any = Settings()
    for p in dotted.split("."):
        obj = obj[p] if isinstance(obj, dict) else getattr(obj, p)
    return obj


def _env_values(env, sources: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    known = {env_name(d): d for d, _, _ in leaves()}
    for var, dotted in ENV_OVERRIDES.items():
        if var in env and known.get(var) is None:
            out[dotted] = _from_text(dotted, env[var], var)
            sources[dotted] = var
    for var, value in env.items():
        if var in known:
            out[known[var]] = _from_text(known[var], value, var)
            sources[known[var]] = var
        elif var.startswith(ENV_PREFIX) and "__" in var:
            raise ConfigError(f"unknown setting in the environment: {var} (settings are "
                              f"{ENV_PREFIX}<SECTION>__<KEY>, docs/reference/settings.md)")
    return out


_adapter = None


def adapter():
    """The pydantic validator of `Settings`, built once (~0.3-0.5 s here): `relay up`'s
    zygote builds it before forking the roles, which then share it (relay/zygote.py)."""
    global _adapter
    import pydantic   # imported here: only a process that loads settings pays for it
    if _adapter is None:
        _adapter = pydantic.TypeAdapter(Settings)
    return _adapter


def validate(data: dict[str, Any], sources: dict[str, str] | None = None) -> "Settings":
    """`data` (the settings tree as dicts) as `Settings`, every value checked against its
    type and `allowed`: the first value that is not raises ConfigError."""
    import pydantic
    sources = sources or {}
    try:
        settings = adapter().validate_python(data)
    except pydantic.ValidationError as e:
        errs = e.errors(include_url=False)
        first = errs[0]
        parts = [str(p) for p in first["loc"] if not isinstance(p, int)]
        known = {d for d, _, _ in leaves()}
        # a union's member names its branch after the setting ("state_store.bool"): cut it
        cut = next((n for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in known),
                   len(parts))
        dotted = ".".join(parts[:cut])
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        try:
            want = f"must be {allowed(dotted)} ({_readable(first)})"
        except (AttributeError, KeyError, TypeError):   # a whole section of the wrong kind
            want = _readable(first)
        raise ConfigError(f"setting {dotted} = {first.get('input')!r} "
                          f"(from {_source(sources, dotted)}): {want}{more}") \
            from None
    for dotted, _, _ in leaves():
        value = _default_from(settings, dotted)
        lo, hi, _ = _range(dotted)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (
                (lo is not None and value < lo) or (hi is not None and value > hi)):
            raise ConfigError(f"setting {dotted} = {value!r} (from "
                              f"{_source(sources, dotted)}): must be "
                              f"{allowed(dotted)}")
    _check_retention(settings.compaction, sources)
    if settings.ingress.lease_renew_seconds * 2 > settings.ingress.lease_seconds:
        raise ConfigError(
            f"setting ingress.lease_renew_seconds = {settings.ingress.lease_renew_seconds} (from "
            f"{_source(sources, 'ingress.lease_renew_seconds')}): must be at most half of "
            f"ingress.lease_seconds ({settings.ingress.lease_seconds:g}): a lease must survive "
            f"a missed renewal")
    peer = settings.cluster
    if peer.peer_listen and not peer.peer_advertise \
            and (peer.peer_bind or settings.bind) in ("0.0.0.0", "::", ""):
        raise ConfigError(
            f"setting cluster.peer_listen = true (from {_source(sources, 'cluster.peer_listen')})"
            f" binds every address ({peer.peer_bind or settings.bind!r}): set "
            f"cluster.peer_advertise to the address other hosts dial")
    return settings


# Files no log names are deleted once older than the bound's slack (delivered_bound_seconds
# - ack_grace_seconds - 2 x interval_seconds, jobs/compact.py): a write in progress commits
# its files within seconds, so the slack may not be shorter than this.
ORPHAN_MIN_AGE_SECONDS = 10


def orphan_age_seconds(conf: CompactionConf) -> int:
    """How old a file no log names must be before compaction deletes it: the bound's slack
    once an ack has waited the grace and one interval for the run that purges its row (a
    failed write of that run may hold the envelope), and one more interval for the sweep."""
    return conf.delivered_bound_seconds - conf.ack_grace_seconds - 2 * conf.interval_seconds


def _check_retention(conf: CompactionConf, sources: dict[str, str]) -> None:
    """The compaction schedule must keep the delivered-bytes bound: an ack waits the grace,
    then up to one interval for the run that rewrites its files, then the retention (for a
    file no log names, `orphan_age_seconds`, at least ORPHAN_MIN_AGE_SECONDS), then up to one
    more interval for the run that deletes them."""
    need = conf.ack_grace_seconds + 2 * conf.interval_seconds + max(
        conf.vacuum_retention_seconds, ORPHAN_MIN_AGE_SECONDS)
    if need > conf.delivered_bound_seconds:
        raise ConfigError(
            f"setting compaction.delivered_bound_seconds = {conf.delivered_bound_seconds} "
            f"(from {_source(sources, 'compaction.delivered_bound_seconds')}): must be at "
            f"least ack_grace_seconds + 2 x interval_seconds + vacuum_retention_seconds "
            f"(at least {ORPHAN_MIN_AGE_SECONDS}) = {need}")


def _source(sources: dict[str, str], dotted: str) -> str:
    while dotted:
        if dotted in sources:
            return sources[dotted]
        dotted = dotted.rpartition(".")[0]
    return "the defaults"


def _readable(err: dict) -> str:
    msg = err["msg"]
    return msg[0].lower() + msg[1:] if msg else msg


def _default_from(obj: Any, dotted: str) -> Any:
    for p in dotted.split("."):
        obj = getattr(obj, p)
    return obj


# Ranges other than the rule (every number setting is at least 0; a port, at most 65535):
# (lowest, highest, how a person says it); None: no bound.
RANGES: dict[str, tuple[float | None, float | None, str]] = {
    # the pepper id is floor(unix time / period): under a second it would divide by zero
    "ppp.discovery_pepper_rotation_hours": (1 / 3600, None, "at least 1/3600 (one second)"),
    "sync.new_connection_cpu_share": (0, 1, "from 0 to 1"),
    # a lease must outlive a few renewals (node_lease.py)
    "ingress.lease_seconds": (1, None, "at least 1"),
    "ingress.lease_renew_seconds": (0.1, None, "at least 0.1"),
    "cluster.peer_refresh_seconds": (0.1, None, "at least 0.1"),
    "ingress.control_follow_seconds": (0.05, None, "at least 0.05"),
    # 0 would delete every reject and audit row as it is written
    "compaction.audit_retention_days": (1 / 86400, None, "at least 1/86400 (one second)"),
}


def _range(dotted: str) -> tuple[float | None, float | None, str]:
    if dotted in RANGES:
        return RANGES[dotted]
    if dotted.endswith("port"):
        return 0, 65535, "from 0 to 65535"
    return 0, None, ">= 0"


# Settings that take one of a few words beside true/false: what a person is told.
CHOICES: dict[str, str] = {"stream.state_store": 'true, false or "auto"'}


def allowed(dotted: str) -> str:
    """What a setting accepts, for a person: the error line and the reference page."""
    if dotted in CHOICES:
        return CHOICES[dotted]
    default = _default(dotted)
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, (int, float)):
        kind = "an integer" if isinstance(default, int) else "a number"
        return f"{kind} {_range(dotted)[2]}"
    if isinstance(default, list):
        return "a list of integers (env: JSON)"
    if isinstance(default, dict):
        return "a table (env: a JSON object)"
    return "text"


def default_conf_file() -> Path | None:
    """`RELAY_CONF` if set, else `conf/relay.toml` in the working directory if present."""
    env = os.environ.get("RELAY_CONF")
    if env:
        return Path(env)
    local = Path("conf/relay.toml")
    return local if local.exists() else None


def load(path: str | os.PathLike | None = None, env: dict[str, str] | None = None,
         **overrides: Any) -> Settings:
    """Build settings: defaults, then the TOML file, then environment (`env_name` and the
    older names of ENV_OVERRIDES), then keyword overrides given as dotted paths with `__`
    (`trueseal__push_port=0`); then validate them all (ConfigError: one line)."""
    data = dataclasses.asdict(Settings())
    sources: dict[str, str] = {}
    conf = Path(path) if path else default_conf_file()
    if conf is not None:
        try:
            with open(conf, "rb") as fh:
                toml = tomllib.load(fh)
        except OSError as e:
            raise ConfigError(f"settings file {conf}: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"settings file {conf} is not TOML: {e}") from None
        _merge(data, toml, "", sources, str(conf))
    env = os.environ if env is None else env
    for dotted, value in _env_values(env, sources).items():
        _set_leaf(data, dotted, value)
    names = {d for d, _, _ in leaves()}
    for key, value in overrides.items():
        dotted = key.replace("__", ".")
        if dotted not in names:
            raise ConfigError(f"unknown setting {dotted}")
        _set_leaf(data, dotted, os.fspath(value) if isinstance(value, os.PathLike) else value)
        sources[dotted] = "command line"
    return validate(data, sources)


def _fill_kinds() -> None:
    for dotted, _, _ in leaves():
        default = _default(dotted)
        if isinstance(default, dict):
            _MAPS.add(dotted)
        elif isinstance(default, list):
            _LISTS.add(dotted)


_fill_kinds()


def as_dict(settings: Settings) -> dict[str, Any]:
    return dataclasses.asdict(settings)
