"""MkDocs hook: the CLI reference page, rendered from `relay.cli.build_parser()` at build time.

`docs/reference/cli.md` holds only an introduction and the marker below; every command, option,
default and help text comes from the argparse parser the `relay` command itself runs, so the page
cannot drift from the code. `python docs/hooks/cli_reference.py` prints the rendered Markdown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MARKER = "<!-- cli-reference -->"
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))   # MkDocs loads hooks by path
from page_marker import cell, fill  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from relay.cli import build_parser
    return build_parser()


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                out.append((name, helps.get(name, ""), sub))
    return out



def _options(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(f"`{o}`" for o in a.option_strings) or f"`{a.dest}` (positional)"
        if a.option_strings and a.nargs != 0:
            name += f" `{a.metavar or a.dest.upper()}`"
        extra = []
        if a.choices:
            extra.append("one of " + ", ".join(f"`{c}`" for c in a.choices))
        if a.default not in (None, False, argparse.SUPPRESS) and a.nargs != 0:
            extra.append(f"default `{a.default}`")
        text = cell(a.help or "")
        if extra:
            text = (text + " " if text else "") + "(" + "; ".join(extra) + ")"
        rows.append(f"| {name} | {text} |")
    if not rows:
        return []
    return ["| option | meaning |", "|---|---|", *rows, ""]


def render() -> str:
    parser = _parser()
    lines: list[str] = []

    def walk(p: argparse.ArgumentParser, path: list[str], help_text: str) -> None:
        subs = _subcommands(p)
        title = " ".join(["relay", *path])
        lines.append(f"{'#' * min(2 + max(len(path) - 1, 0), 4)} `{title}`")
        lines.append("")
        if help_text:
            text = cell(help_text).rstrip(".")
            lines.append(text[:1].upper() + text[1:] + ".")
            lines.append("")
        lines.append("```")
        lines.append(p.format_usage().strip().replace("usage: ", "", 1))
        lines.append("```")
        lines.append("")
        lines.extend(_options(p))
        for name, sub_help, sub in subs:
            walk(sub, [*path, name], sub_help)

    lines.append("## Options every command takes")
    lines.append("")
    lines.append("Given before the command: `relay --data-dir /srv/relay status`.")
    lines.append("")
    lines.extend(_options(parser))
    for name, sub_help, sub in _subcommands(parser):
        walk(sub, [name], sub_help)
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:   # MkDocs hook
    return fill(markdown, page.file.src_uri, "reference/cli.md", MARKER, render)


if __name__ == "__main__":
    print(render())
