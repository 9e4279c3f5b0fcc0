"""What the two generated pages share (imported by cli_reference.py)."""

from __future__ import annotations

import re
from typing import Callable


def cell(text: str) -> str:
    """One Markdown table cell: one line, pipes escaped, < and > escaped outside code spans,
    no issue references (they mean nothing to a reader of the site)."""
    text = re.sub(r"\s*\(issue \d+\)", "", " ".join(str(text).split()))
    text = re.sub(r"\(issue \d+[;,] ?", "(", text).replace("|", "\\|")
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def fill(markdown: str, src_uri: str, page_uri: str, marker: str,
         render: Callable[[], str]) -> str:
    """The page `page_uri` with its marker replaced by `render()`; other pages unchanged."""
    if src_uri != page_uri:
        return markdown
    if marker not in markdown:
        raise ValueError(f"{page_uri} lost its marker {marker}")
    return markdown.replace(marker, render())
