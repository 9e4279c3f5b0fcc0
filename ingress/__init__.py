"""Ingress: every protocol listener, writing what clients push to this node's landing tables.

A protocol whose one socket both sends and receives (Heya, PPP, cursor-sync) is composed
here, in the ingress process that owns the socket, from an ingress half (landing through
the group commit, the control tables) and an egress half (its inbox view in `egress/`). The
modules below are those compositions, and the only ones that import `egress/`
(tests/test_layout.py holds every other module to it).
"""

COMPOSITION = (
    "ingress.heya",          # Heya: SEND -> landing; HAVE / WANT from egress.heya_inbox
    "ingress.ppp_app",       # PPP port: WebSocket + HTTP, with egress.ppp_inbox and its tail
    "ingress.ppp_service",   # PPP commands: STORE -> landing; FETCH / ACK from egress.ppp_inbox
    "ingress.ppp_rooms",     # PPP rooms: STORE_ROOM -> landing; FETCH_ROOM from egress.ppp_rooms
    "ingress.ppp_carry",     # PPP carry groups: control rows; FETCH_CARRY from egress.ppp_inbox
    "ingress.sync_quic",     # cursor-sync over aioquic: the listener and its shared state
    "ingress.sync_requests",  # cursor-sync requests: PUSH -> landing; PULL / NOTIFY from egress.sync_inbox
)
