"""The documentation stays true to the code: every `relay ...` command, setting name and
environment variable that README.md or docs/**/*.md names exists, and the docs site builds with
`mkdocs build --strict` with every internal link and anchor of the built HTML resolving.

The commands are checked against the parser `relay` itself runs (`relay.cli.build_parser()`),
the settings against `runtime.config.Settings`, the variables against `ENV_OVERRIDES` and the
code that reads them; fast, no Spark, no network.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from relay.cli import build_parser
from runtime import config, settings_doc

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(```|~~~)")
FILE_SUFFIX = re.compile(r"\.(py|md|json|toml|ipynb|png|txt|pem|crt|key|seed|ya?ml|sh|pth|"
                         r"properties|html|carried|parquet)$")


def _code(text: str) -> list[str]:
    """Inline code spans and fenced code lines (continuations joined, comments cut)."""
    out: list[str] = []
    in_fence = False
    pending = ""
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            in_fence = not in_fence
            continue
        if in_fence:
            line = re.sub(r"(^|\s)#(\s.*)?$", "", line)
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            out.append(pending + line)
            pending = ""
        else:
            out.extend(m.group(1) for m in re.finditer(r"`([^`\n]+)`", line))
    return out


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in p._actions for o in a.option_strings}


def _check_command(tokens: list[str], root: argparse.ArgumentParser) -> str | None:
    """None if `relay <tokens>` parses as far as it names things; else what is wrong."""
    p, path = root, ["relay"]
    i = 0
    while i < len(tokens):
        t = tokens[i].strip("[](),.;:'\"").replace("\\|", "|")
        if not t or t in {"/", "...", "..", "…"} or t.startswith(("<", "|", ">", "&", "#")):
            return None   # alternatives, a placeholder or the end of the command: stop here
        if t.startswith("-"):
            name = t.split("=", 1)[0]
            opts = {**_options(p), **(_options(root) if p is root else {})}
            if name not in opts:
                return f"{' '.join(path)} has no option {name}"
            if opts[name].nargs != 0 and "=" not in t:
                i += 1   # its value
        else:
            subs = _subparsers(p)
            if subs:
                alternatives = t.split("|")
                missing = [a for a in alternatives if a not in subs]
                if missing:
                    if not re.fullmatch(r"[a-z][a-z-]*", t):
                        return None   # a placeholder (P, N, spark://...)
                    return f"{' '.join(path)} has no command {missing[0]}"
                if len(alternatives) > 1:
                    return None
                p = subs[t]
                path.append(t)
        i += 1
    return None


def _commands(text: str) -> list[list[str]]:
    found = []
    for span in _code(text):
        for m in re.finditer(r"(?:^|(?<=[\s(]))(?:\S*/)?relay(?=\s|$)", span):
            rest = span[m.end():].split(")")[0]   # $(relay keys | ...) ends at its ")"
            rest = re.split(r"\s(?:&&|\|\||;|\||>|2>|#)\s|\s\|$", rest)[0]
            found.append(rest.split())
    return found


def test_documented_commands_exist():
    root = build_parser()
    wrong = []
    for page in PAGES:
        for tokens in _commands(page.read_text()):
            if (err := _check_command(tokens, root)):
                wrong.append(f"{page.relative_to(ROOT)}: `relay {' '.join(tokens)}`: {err}")
    assert not wrong, "\n".join(wrong)


def test_the_command_check_catches_what_is_gone():
    root = build_parser()
    assert _check_command(["ppp", "room", "knock", "--room-id", "X"], root) is None
    assert _check_command(["--data-dir", "D", "status", "--json"], root) is None
    assert "no command" in _check_command(["ppp", "teleport"], root)
    assert "no option --data-dir" in _check_command(["loadgen", "--data-dir", "D"], root)
    assert _commands("run `relay bench --peer` and\n```\n.venv/bin/relay keys | head\n"
                     "x --a $(relay heya inbox-token) --b\n```") \
        == [["bench", "--peer"], ["keys"], ["heya", "inbox-token"]]


def _setting_exists(dotted: str) -> bool:
    obj: object = config.Settings()
    for part in dotted.split("."):
        if isinstance(obj, dict):
            return True   # a table of free keys ([stream.spark_conf])
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _settings(text: str) -> set[str]:
    sections = {f.name for f in dataclasses.fields(config.Settings)
                if dataclasses.is_dataclass(getattr(config.Settings(), f.name))}
    names = set()
    for span in _code(text):
        for m in re.finditer(r"(?<![\w./-])\[?([a-z_]+(?:\.[a-z_][a-z0-9_]*)+)\]?(?![\w/(-])", span):
            name = m.group(1)
            if name.split(".")[0] in sections and not FILE_SUFFIX.search(name) \
                    and not re.search(r"\.v\d+$", name):   # a hash person: trueseal.evt.v1
                names.add(name)
    return names


def test_documented_settings_exist():
    wrong = [f"{page.relative_to(ROOT)}: {name}"
             for page in PAGES for name in sorted(_settings(page.read_text()))
             if not _setting_exists(name)]
    assert not wrong, "settings named in the docs that runtime/config.py lacks:\n" + \
        "\n".join(wrong)


def _code_text() -> str:
    """Every source file that may read an environment variable or export a metric."""
    files = [ROOT / "setup.sh", ROOT / ".ci" / "run", *ROOT.glob("*.py")]
    for package in ("engine", "ingress", "egress", "jobs", "delta_tables", "runtime", "relay",
                    "tests", "notebooks", "examples"):
        files += [*(ROOT / package).rglob("*.py"), *(ROOT / package).rglob("*.ipynb")]
    return "\n".join(f.read_text(errors="replace") for f in files if f.is_file())


def _env_vars(text: str) -> set[str]:
    names = set()
    for m in re.finditer(r"\b((?:RELAY|PPP)_[A-Z0-9_]*)(\{[A-Z0-9_,]+\})?([A-Z0-9_]*)", text):
        head, braces, tail = m.groups()
        for alt in (braces[1:-1].split(",") if braces else [""]):
            name = head + alt + tail
            if not name.endswith("_"):   # RELAY_APNS_*, RELAY_METRICS_PORT_<ROLE>: a family
                names.add(name)
    return names


def test_documented_environment_variables_exist():
    code = _code_text()
    # every setting's own variable under the naming rule (runtime/config.env_name)
    by_rule = {s.env for s in settings_doc.settings()}
    wrong = [f"{page.relative_to(ROOT)}: {name}"
             for page in PAGES for name in sorted(_env_vars(page.read_text()))
             if name not in config.ENV_OVERRIDES and name not in by_rule
             and f'"{name}"' not in code
             and f"'{name}'" not in code and f"{name}=" not in code]
    assert not wrong, "environment variables named in the docs that no code reads:\n" + \
        "\n".join(wrong)


def test_alert_rules_name_metrics_the_relay_exports():
    code = _code_text()
    wrong = []
    for page in PAGES:
        for line in page.read_text().splitlines():
            if "expr:" not in line:
                continue
            for name in re.findall(r"\brelay_[a-z_]+", line):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                if f'"{base}"' not in code:
                    wrong.append(f"{page.relative_to(ROOT)}: {name}")
    assert not wrong, "\n".join(wrong)


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name") if tag != "meta" else ():
            if a.get(key):
                self.ids.add(a[key])
        for key in ("href", "src"):
            if a.get(key) and tag in ("a", "link", "img", "script", "source"):
                self.links.append(a[key])


def _broken_links(site: Path) -> list[str]:
    pages = {p: _Links() for p in site.rglob("*.html")}
    for p, parser in pages.items():
        parser.feed(p.read_text())
    broken = []
    for p, parser in pages.items():
        for link in parser.links:
            u = urlsplit(link)
            if u.scheme or link.startswith("//"):
                continue   # external: not ours to check
            if p.name == "404.html" and link.startswith("/"):
                continue   # the 404 page links from the site's root, wherever it is served
            target = (p.parent / unquote(u.path)).resolve() if u.path else p
            if target.is_dir():
                target = target / "index.html"
            where = f"{p.relative_to(site)} -> {link}"
            if not target.exists() or site.resolve() not in [target, *target.parents]:
                broken.append(f"{where}: no such file")
            elif u.fragment and target.suffix == ".html" and target in pages \
                    and unquote(u.fragment) not in pages[target].ids:
                broken.append(f"{where}: no such anchor")
    return broken


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                          "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


def test_site_builds_strict_and_every_internal_link_resolves(site):
    assert (site / "index.html").exists()
    assert not (site / "hooks").exists()
    broken = _broken_links(site)
    assert not broken, "\n".join(broken)


def test_references_are_rendered_from_the_code(site):
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for name, sub in _subparsers(build_parser()).items():
        assert f"relay {name}" in cli
    settings = (site / "reference" / "settings" / "index.html").read_text()
    assert "stream.max_ttl_seconds" in settings and "RELAY_PPP_PORT" in settings
    assert "<!-- cli-reference -->" not in cli and "<!-- settings-reference -->" not in settings


def test_the_link_check_finds_a_broken_link(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "index.html").write_text('<h2 id="x">x</h2><a href="a/">a</a><a href="#x">x</a>')
    (tmp_path / "a" / "index.html").write_text(
        '<a href="../#x">ok</a><a href="../#y">bad anchor</a><a href="../b/">bad file</a>')
    assert _broken_links(tmp_path) == ["a/index.html -> ../#y: no such anchor",
                                       "a/index.html -> ../b/: no such file"]


def test_readme_links_point_at_files_that_exist():
    text = (ROOT / "README.md").read_text()
    missing = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
               if not urlsplit(t).scheme and not (ROOT / t).exists()]
    assert not missing, missing


def test_the_setting_and_variable_checks_catch_what_is_gone():
    assert _settings("`stream.max_ttl_seconds`, `[push.apns]`, `ppp.py`, `trueseal.evt.v1`, "
                     "`sync.open_groups = true`, `jobs.batch_profile`") == \
        {"stream.max_ttl_seconds", "push.apns", "sync.open_groups"}
    assert _setting_exists("push.apns.key_file") and _setting_exists("stream.spark_conf.x")
    assert not _setting_exists("stream.max_ttl_days")
    assert _env_vars("`RELAY_METRICS_PORT_{INGRESS,EGRESS}`, `RELAY_APNS_*`, PPP_TRUSTED_PROXIES") \
        == {"RELAY_METRICS_PORT_INGRESS", "RELAY_METRICS_PORT_EGRESS", "PPP_TRUSTED_PROXIES"}


def test_pages_a_person_reads_carry_no_issue_numbers(site):
    """Issue numbers mean nothing to an operator; dated logs live in docs/results/ only."""
    found = []
    for page in [*PAGES, *site.rglob("*.html")]:
        rel = page.relative_to(ROOT if page.suffix == ".md" else site)
        if rel.parts[:2] == ("docs", "results") or rel.parts[:1] == ("results",):
            continue
        text = page.read_text()
        found += [f"{rel}: {m.group(0)}" for m in re.finditer(r"\b[Ii]ssues? #?\d+", text)]
    assert not found, "\n".join(found)
