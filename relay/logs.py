"""Structured JSON logs, one object per line, with a stable `event` vocabulary.

Fields come from `extra={...}` at the call site. What may never appear (envelope bytes, keys,
client addresses) is simply never passed; as a second guard, bytes values are replaced by
their length so a careless `extra` cannot leak ciphertext or a key.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(),
               "process": self.process, "logger": record.name, "msg": record.getMessage()}
        for k, v in record.__dict__.items():
            if k not in _STD and not k.startswith("_"):
                out[k] = f"<{len(v)} bytes>" if isinstance(v, (bytes, bytearray)) else v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info).splitlines()[-1]
        return json.dumps(out, default=str)


def setup(process: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(process))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("py4j", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
