"""What a PPP client keeps on the device besides its seed: a directory of small JSON files,
each 0600 and replaced atomically (write, fsync, rename), so a crash leaves the old or the
new file and never half of one.

    contacts.json   pinned contacts (§9 PinnedContact: never sent to the relay)
    invites.json    verification invites I issued, until accepted or expired (§9)
    outbox.json     events built and encrypted but not yet acknowledged by a relay (§12
                    offline creation and queuing: the same bytes are retried, so a retry
                    the relay already holds is refused as a duplicate, not stored twice)
    blinded.json    per contact: the blinded mailboxes already emptied and the last day
                    whose sealed token is registered (`ppp_client.receive_blinded`)
    mail.jsonl      every event received and opened, one JSON object a line: the history a
                    backup carries to a new device (§6 backups)

The default directory is `<seed file>.d` beside the seed file; the CLI's `--state` moves it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (json.dumps(value, ensure_ascii=False, indent=1) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class Device:
    """The state directory of one identity on one device."""

    FILES = ("contacts", "invites", "outbox", "blinded")

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def beside(cls, seed_path: str | Path, state: str | Path | None = None) -> "Device":
        return cls(state if state is not None else f"{seed_path}.d")

    def _file(self, name: str) -> Path:
        return self.path / name

    def load(self, name: str, default: Any) -> Any:
        try:
            return json.loads(self._file(f"{name}.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            return default
        except json.JSONDecodeError as e:
            raise ValueError(f"{self._file(name + '.json')}: not valid JSON ({e})") from e

    def save(self, name: str, value: Any) -> None:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write_json(self._file(f"{name}.json"), value)

    # --- the received mail, append-only ---------------------------------------------------
    def append_mail(self, entries: list[dict]) -> int:
        """Add received events not already kept (by event id); returns how many were new."""
        if not entries:
            return 0
        have = {m["event_id"] for m in self.mail()}
        new = [e for e in entries if e.get("event_id") not in have and "error" not in e]
        if new:
            self._write_mail(new, append=True)
        return len(new)

    def _write_mail(self, entries: list[dict], *, append: bool) -> None:
        """Append to mail.jsonl, or replace it whole (written aside, then renamed)."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        target = self._file("mail.jsonl")
        path = target if append else self._file("mail.jsonl.tmp")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC),
                     0o600)
        try:
            os.write(fd, "".join(json.dumps(e, ensure_ascii=False) + "\n"
                                 for e in entries).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        if not append:
            os.replace(path, target)

    def remove_mail(self, presence_id: str, sender: str) -> int:
        """A REVOKE (§4.3): drop the sender's message with that presence id."""
        mail = self.mail()
        keep = [m for m in mail if not (m.get("presence_id") == presence_id
                                        and m.get("sender") == sender)]
        if len(keep) != len(mail):
            self._write_mail(keep, append=False)
        return len(mail) - len(keep)

    def mail(self) -> list[dict]:
        try:
            text = self._file("mail.jsonl").read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    # --- everything, for a backup --------------------------------------------------------
    def snapshot(self) -> dict:
        """What a backup carries (the outbox too: unsent mail survives a lost device)."""
        out = {name: self.load(name, None) for name in self.FILES}
        out["mail"] = self.mail()
        return {k: v for k, v in out.items() if v not in (None, [], {})}

    def restore(self, snap: dict) -> None:
        for name in self.FILES:
            if name in snap:
                self.save(name, snap[name])
        if snap.get("mail"):
            self.append_mail(snap["mail"])
