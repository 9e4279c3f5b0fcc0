"""The process's file descriptors: raise the limit at start, and where listeners stop accepting.

Every socket is a descriptor, and so is every file a Delta commit opens. A process that lets
its listeners take them all cannot commit what it acked, log, or serve /metrics (issue 19:
"storage unavailable" and a delta-rs panic once 20,000 silent connections were held). So:

* `raise_limit()`, once at process start (ingress and egress `run`): RLIMIT_NOFILE's soft
  limit up to its hard limit (the default soft limit, often 1024, is far below what the
  listeners' caps add up to).
* `ceiling(reserve)`: the descriptor number at which listeners stop accepting, leaving
  `reserve` descriptors (`process.open_files_reserve`) for everything else.
* `lowest_free()`: the lowest free descriptor number. The kernel hands out the lowest free
  number (POSIX), so when the number an accept() returned, or this probe, is at or past the
  ceiling, fewer than `reserve` descriptors are left.
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger("relay.open_files")

DEFAULT_RESERVE = 256


def raise_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE to the hard limit; returns (soft, hard) as they are now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        target = max(soft, 1 << 20) if soft != resource.RLIM_INFINITY else soft
    else:
        target = hard
    if soft != target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    log.info("open files limit", extra={"event": "open_files_limit", "soft": soft,
                                        "hard": hard})
    return soft, hard


def ceiling(reserve: int) -> int:
    """Descriptor numbers from here on are the reserve: a listener does not take them."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(1, soft - reserve)


def lowest_free() -> int | None:
    """The lowest free descriptor number, or None when there is none at all (EMFILE)."""
    try:
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    os.close(fd)
    return fd
