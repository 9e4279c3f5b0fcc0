"""The settings reference, rendered from the one definition (runtime/config.py): each
setting's dotted name, environment variable, type, default, what is allowed and its
description (the comment above the field, or beside it). Two files are made from it and a
test (tests/test_settings_doc.py) fails when either differs from what this renders:

* docs/reference/settings.md, the reference page;
* the header of conf/relay.toml (every line before its first setting): the naming rule of
  the environment variables and the older names that still work.

    python -m runtime.settings_doc          # rewrite both
    python -m runtime.settings_doc --check  # exit 1 if either is stale
"""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
from pathlib import Path

from runtime import config

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "settings.md"
CONF = ROOT / "conf" / "relay.toml"
REGENERATE = ".venv/bin/python -m runtime.settings_doc"


@dataclasses.dataclass(frozen=True)
class Setting:
    dotted: str
    env: str
    type: str
    default: object
    allowed: str
    description: str
    aliases: tuple[str, ...]


def _comments() -> dict[tuple[str, str], tuple[str, str]]:
    """(class, field) -> (its annotation as written, its description) from config.py's
    source: the comment lines right above a field, else the comment at the end of its line."""
    source = Path(config.__file__).read_text()
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        group, last_end = "", -1
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            above = []
            i = item.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i].strip()[1:].strip())
                i -= 1
            end = lines[item.end_lineno - 1]
            beside = end.split("  # ", 1)[1].strip() if "  # " in end else ""
            text = " ".join(a for a in above if not a.startswith("---"))
            if beside:
                text = f"{text} {beside}".strip() if text else beside
            if above:
                group = " ".join(a for a in above if not a.startswith("---"))
            elif item.lineno - 1 != last_end + 1 and not beside:
                group = ""
            if not text and item.lineno - 1 == last_end + 1:
                text = group   # a field right under others shares the comment above them
            last_end = item.end_lineno - 1
            out[(node.name, item.target.id)] = (ast.unparse(item.annotation), text)
    return out


def settings() -> list[Setting]:
    notes = _comments()
    aliases: dict[str, list[str]] = {}
    for var, dotted in config.ENV_OVERRIDES.items():
        aliases.setdefault(dotted, []).append(var)
    out = []
    for dotted, f, cls in config.leaves():
        kind, text = notes.get((cls.__name__, f.name), ("", ""))
        out.append(Setting(dotted, config.env_name(dotted), kind, config._default(dotted),
                           config.allowed(dotted), text, tuple(aliases.get(dotted, ()))))
    return out


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (str, list)):
        return json.dumps(value)
    return repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_page() -> str:
    rows = settings()
    out = [
        "# Settings reference",
        "",
        "<!-- Generated from runtime/config.py by `python -m runtime.settings_doc`; do not "
        "edit. -->",
        "",
        "Every relay process reads its settings in this order, each over the one before: the "
        "built-in defaults, the settings file (`--conf`, else `$RELAY_CONF`, else "
        "`conf/relay.toml` in the working directory), the environment, then `relay "
        "--data-dir`. Every value is checked before anything starts: a value of the wrong "
        "type or out of range stops the command with one line naming the setting, the "
        "value, where it came from and what is allowed, and exit status 2.",
        "",
        "## Environment variables",
        "",
        "Every setting has one: `RELAY_` and the setting's dotted name in capitals, with `__` "
        "between the parts (`push.fcm.ca_file` is `RELAY_PUSH__FCM__CA_FILE`, `data_dir` is "
        "`RELAY_DATA_DIR`). Lists and tables are given as JSON "
        "(`RELAY_STREAM__PADDING_BUCKETS='[256, 1024]'`). A variable that starts with "
        "`RELAY_`, has `__` in it and names no setting is refused.",
        "",
        "Older names still work beside the rule:",
        "",
        "| variable | setting |",
        "|---|---|",
    ]
    out += [f"| `{var}` | `{dotted}` |" for var, dotted in config.ENV_OVERRIDES.items()]
    out += ["", "Other variables the relay reads (not settings of the file):", "",
            "| variable | meaning |", "|---|---|"]
    out += [f"| `{var}` | {_cell(text)} |" for var, text in config.ENV_OTHER.items()]
    section = None
    for s in rows:
        head = s.dotted.rsplit(".", 1)[0] if "." in s.dotted else ""
        if head != section:
            section = head
            out += ["", f"## `[{head}]`" if head else "## Top level", "",
                    "| setting | environment | type | default | allowed | description |",
                    "|---|---|---|---|---|---|"]
        env = f"`{s.env}`" + "".join(f"<br>`{a}`" for a in s.aliases)
        out.append(f"| `{s.dotted}` | {env} | `{_cell(s.type)}` | `{_cell(_toml(s.default))}` "
                   f"| {_cell(s.allowed)} | {_cell(s.description)} |")
    return "\n".join(out) + "\n"


def render_conf_header() -> str:
    alias = [f"{var} ({dotted})" for var, dotted in config.ENV_OVERRIDES.items()]
    lines = [
        "# Relay settings. Every value here is the built-in default (tests/test_config.py "
        "keeps the two",
        "# equal); edit to change. This header is generated from runtime/config.py (`python "
        "-m",
        "# runtime.settings_doc`), with docs/reference/settings.md, which describes every "
        "setting.",
        "#",
        "# Environment variables override this file, one per setting: RELAY_ and the dotted "
        "name in",
        "# capitals with __ between the parts; lists and tables as JSON. E.g.",
        "#   RELAY_DATA_DIR, RELAY_TRUESEAL__PUSH_PORT, RELAY_PUSH__FCM__CA_FILE,",
        "#   RELAY_PPP__DISCOVERY_PEPPER_ROTATION_HOURS, RELAY_STREAM__PADDING_BUCKETS='[256, "
        "1024]'",
        "# Older names that still work:",
    ]
    line = "#  "
    for i, a in enumerate(alias):
        piece = " " + a + ("," if i < len(alias) - 1 else "")
        if len(line) + len(piece) > 96:
            lines.append(line)
            line = "#  "
        line += piece
    lines.append(line)
    lines.append("# Other variables:")
    for var, text in config.ENV_OTHER.items():
        lines.append(f"#   {var}: {text}")
    lines.append("# and `relay --data-dir` overrides them all. Spark's driver JVM logs "
                 "through conf/log4j2.properties.")
    return "\n".join(lines) + "\n"


def _split_conf(text: str) -> tuple[str, str]:
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines) and lines[i].startswith("#"):
        i += 1
    return "".join(lines[:i]), "".join(lines[i:])


def stale() -> list[str]:
    """The generated files that differ from what this module renders."""
    out = []
    if not PAGE.exists() or PAGE.read_text() != render_page():
        out.append(str(PAGE.relative_to(ROOT)))
    head, _ = _split_conf(CONF.read_text())
    if head != render_conf_header():
        out.append(str(CONF.relative_to(ROOT)))
    return out


def write() -> None:
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(render_page())
    _, body = _split_conf(CONF.read_text())
    CONF.write_text(render_conf_header() + body)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--check" in argv:
        bad = stale()
        for path in bad:
            print(f"{path} is stale: run {REGENERATE}", file=sys.stderr)
        return 1 if bad else 0
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
