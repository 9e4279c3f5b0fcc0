"""PPP (place- and time-gated events): pure codecs, crypto and rules; no I/O.

Spec: shared/specs/004_b259c4a0cb273584.txt (appendix C is authoritative over the prose)."""
