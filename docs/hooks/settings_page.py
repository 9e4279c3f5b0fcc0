"""MkDocs hook: the settings reference, generated from `runtime/config.py` at build time.

Every setting of the `Settings` dataclass tree: its dotted name (as in `conf/relay.toml` and
`relay` error messages), its default, the environment variable that overrides it
(`runtime.config.ENV_OVERRIDES`) and the comment written above the field. `docs/reference/
settings.md` holds an introduction and the marker; `python docs/hooks/settings_page.py` prints
the table.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import sys
import tokenize
from pathlib import Path

MARKER = "<!-- settings-reference -->"
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))   # MkDocs loads hooks by path
from page_marker import cell, fill  # noqa: E402
SOURCE = ROOT / "runtime" / "config.py"


def _comments() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comment block right above the field, or its own line's."""
    text = SOURCE.read_text()
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = text.splitlines()
    out: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            block: list[str] = []
            n = item.lineno - 1
            while n >= 1 and lines[n - 1].strip().startswith("#"):
                block.insert(0, by_line.get(n, ""))
                n -= 1
            if item.end_lineno in by_line and not lines[item.end_lineno - 1].strip().startswith("#"):
                block.append(by_line[item.end_lineno])
            out[(node.name, item.target.id)] = " ".join(b for b in block if b)
    return out


def rows() -> list[tuple[str, object, str, str]]:
    """(dotted name, default, env var or '', comment) for every leaf setting."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from runtime import config
    env_of = {dotted: var for var, dotted in config.ENV_OVERRIDES.items()}
    notes = _comments()
    out = []

    def walk(obj: object, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            dotted = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(value):
                walk(value, dotted + ".")
            else:
                out.append((dotted, value, env_of.get(dotted, ""),
                            notes.get((type(obj).__name__, f.name), "")))

    walk(config.Settings(), "")
    return out



def render() -> str:
    lines = ["| setting | default | environment | what it is |", "|---|---|---|---|"]
    for dotted, default, env, note in rows():
        shown = repr(default) if isinstance(default, str) else str(default).lower() \
            if isinstance(default, bool) else default
        lines.append(f"| `{dotted}` | `{cell(shown)}` | {f'`{env}`' if env else ''} | "
                     f"{cell(note)} |")
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:   # MkDocs hook
    return fill(markdown, page.file.src_uri, "reference/settings.md", MARKER, render)


if __name__ == "__main__":
    print(render())
