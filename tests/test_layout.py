"""The product's imports, read with `ast` (module level and inside functions alike): one
direction of dependencies and no cycle. README "How the code is laid out" says the same.

    relay/ (face: CLI, up, status, clients, bench)
      -> ingress/, egress/ (shells), jobs/ (Spark and batch jobs)
        -> delta_tables/ (tables, their writers and folds)
          -> runtime/ (settings, logs, metrics, listeners, TLS, keys)
            -> engine/ (sans-I/O protocol cores, codecs)

A package may import the ones below it, never one above or beside it, with one exception:
the composition modules `ingress.COMPOSITION` put an ingress half and an egress half of one
socket together, and they alone import `egress/`.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "runtime", "delta_tables", "jobs", "egress", "ingress", "relay")

# The product packages each package may import besides itself.
MAY_IMPORT = {
    "engine": set(),
    "runtime": {"engine"},
    "delta_tables": {"engine", "runtime"},
    "jobs": {"engine", "runtime", "delta_tables"},
    "egress": {"engine", "runtime", "delta_tables"},
    "ingress": {"engine", "runtime", "delta_tables"},     # + egress: COMPOSITION only
    "relay": {"engine", "runtime", "delta_tables", "jobs", "egress", "ingress"},
}
# engine/ is pure: outside itself only the standard library and the codecs it is built on
# (s2sphere: S2 cell geometry for PPP rooms, pure arithmetic like the others).
# (mnemonic: BIP-39 words <-> entropy with their checksum for PPP backups, a codec too: it
# reads its word list from its own package once, no I/O of ours.)
# (cryptography: X25519 and ChaCha20-Poly1305, what noiseprotocol itself is built on, used
# directly by the written-out NK responder, engine/noise_nk.py.)
ENGINE_THIRD_PARTY = {"cryptography", "mnemonic", "msgpack", "nacl", "noise", "s2sphere"}
# The benchmark is a tool, not the runtime: only the CLI reaches it, lazily (`relay bench`).
BENCH = "relay.bench"
BENCH_ENTRY = "relay.cli"


@dataclass(frozen=True)
class Edge:
    source: str     # importing module, dotted
    target: str     # imported product module (or, for `external`, the top-level name)
    path: str       # importing file, relative to the root
    line: int
    nested: bool    # inside a function or class body (imported when called)

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}  ({self.path}:{self.line})"


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _nested_nodes(tree: ast.AST) -> set[int]:
    """ids of import nodes inside a function or class body."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return out


def imports(root: Path) -> tuple[list[Edge], list[Edge]]:
    """(edges between product modules, edges to anything else: top-level names)."""
    mods = modules(root)

    def product(name: str) -> str | None:
        parts = name.split(".")
        while parts:
            if ".".join(parts) in mods:
                return ".".join(parts)
            parts.pop()
        return None

    internal, external = [], []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        nested = _nested_nodes(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        rel = str(path.relative_to(root))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base_name = ".".join(base + ([node.module] if node.module else []))
                else:
                    base_name = node.module or ""
                # `from pkg import sub` imports the module pkg.sub when there is one
                names = [f"{base_name}.{a.name}" if f"{base_name}.{a.name}" in mods
                         else base_name for a in node.names]
            else:
                continue
            for name in dict.fromkeys(names):
                target = product(name)
                edge = Edge(mod, target or name.split(".")[0], rel, node.lineno,
                            id(node) in nested)
                if target is None:
                    external.append(edge)
                elif target != mod:
                    internal.append(edge)
    return internal, external


def _package(mod: str) -> str:
    return mod.split(".")[0]


def composition(root: Path) -> set[str]:
    """`ingress.COMPOSITION`, read from ingress/__init__.py without importing it."""
    tree = ast.parse((root / "ingress" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "COMPOSITION" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def direction_problems(internal: list[Edge], composed: set[str]) -> list[str]:
    problems = []
    for e in internal:
        src, dst = _package(e.source), _package(e.target)
        if src == dst:
            continue
        if src == "ingress" and dst == "egress":
            if e.source not in composed:
                problems.append(f"ingress imports egress outside the composition modules "
                                f"{sorted(composed)}: {e}")
        elif dst not in MAY_IMPORT[src]:
            problems.append(f"{src}/ may not import {dst}/: {e}")
    return problems


def engine_problems(external: list[Edge]) -> list[str]:
    allowed = set(sys.stdlib_module_names) | ENGINE_THIRD_PARTY
    return [f"engine/ imports {e.target}, neither the standard library nor one of its codecs "
            f"{sorted(ENGINE_THIRD_PARTY)}: {e}"
            for e in external if _package(e.source) == "engine" and e.target not in allowed]


def bench_problems(internal: list[Edge]) -> list[str]:
    problems = []
    for e in internal:
        into_bench = e.target == BENCH or e.target.startswith(BENCH + ".")
        from_bench = e.source == BENCH or e.source.startswith(BENCH + ".")
        if into_bench and not from_bench and not (e.source == BENCH_ENTRY and e.nested):
            problems.append(f"only {BENCH_ENTRY} may import the benchmark, and only inside "
                            f"the command that runs it: {e}")
    return problems


def cycles(internal: list[Edge]) -> list[list[Edge]]:
    """One cycle (as its edges) per strongly connected component of more than one module."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in internal:
        graph.setdefault(e.source, {}).setdefault(e.target, e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:   # Tarjan; the graph is small enough to recurse
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)

    out = []
    for comp in components:
        start = min(comp)
        # shortest way back to `start` inside the component (breadth first)
        prev: dict[str, Edge] = {}
        frontier = [start]
        while frontier and start not in prev:
            nxt = []
            for v in frontier:
                for w, e in sorted(graph.get(v, {}).items()):
                    if w in comp and w not in prev:
                        prev[w] = e
                        nxt.append(w)
            frontier = nxt
        path, v = [], start
        while True:
            e = prev[v]
            path.append(e)
            v = e.source
            if v == start:
                break
        out.append(path[::-1])
    return out


def cycle_problems(internal: list[Edge]) -> list[str]:
    return ["import cycle:\n    " + "\n    ".join(str(e) for e in cyc)
            for cyc in cycles(internal)]


# --- the product -------------------------------------------------------------------------------

CHECKS = {
    "no_import_cycle": lambda internal, external: cycle_problems(internal),
    "dependencies_point_one_way":
        lambda internal, external: direction_problems(internal, composition(ROOT)),
    "engine_imports_only_the_standard_library_and_its_codecs":
        lambda internal, external: engine_problems(external),
    "the_benchmark_is_loaded_only_by_its_command":
        lambda internal, external: bench_problems(internal),
}


@pytest.mark.parametrize("check", CHECKS)
def test_the_product(check):
    problems = CHECKS[check](*imports(ROOT))
    assert not problems, "\n".join(problems)


def test_the_lists_name_real_modules():
    composed, mods = composition(ROOT), set(modules(ROOT))
    assert composed and all(m.startswith("ingress.") for m in composed)
    assert composed <= mods, "a composition module that does not exist"
    assert BENCH in mods and BENCH_ENTRY in mods


def test_every_composition_module_composes():
    """A module listed as a composition imports both halves; one that no longer does should
    leave the list (the list is the exception, so it stays as short as the code allows)."""
    internal, _ = imports(ROOT)
    for mod in composition(ROOT):
        targets = {_package(e.target) for e in internal if e.source == mod}
        assert "egress" in targets, f"{mod} is listed as a composition but imports no egress/"


# --- the checks themselves: a tree with every fault is caught, edge by edge -------------------

def test_the_checks_catch_a_bad_tree(tmp_path):
    files = {
        "engine/__init__.py": "",
        "engine/core.py": "import socket\nimport pyarrow\nfrom runtime import config\n",
        "runtime/__init__.py": "",
        "runtime/config.py": "def f():\n    from ingress import shell\n",
        "delta_tables/__init__.py": "",
        "delta_tables/table.py": "from egress import view\n",
        "jobs/__init__.py": "",
        "jobs/job.py": "from ingress.shell import X\n",
        "egress/__init__.py": "",
        "egress/view.py": "from ingress import shell\n",
        "ingress/__init__.py": "COMPOSITION = ('ingress.both',)\n",
        "ingress/shell.py": "from egress.view import V\nfrom relay import cli\n",
        "ingress/both.py": "from egress import view\n",
        "relay/__init__.py": "",
        "relay/cli.py": "from .up import go\ndef bench():\n    from .bench import run\n",
        "relay/up.py": "from . import cli\nfrom .bench import harness\n",
        "relay/bench/__init__.py": "",
        "relay/bench/harness.py": "from . import run\n",
        "relay/bench/run.py": "from .harness import x\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    internal, external = imports(tmp_path)
    composed = composition(tmp_path)
    assert composed == {"ingress.both"}

    direction = "\n".join(direction_problems(internal, composed))
    assert "engine/ may not import runtime/: engine.core -> runtime.config  (engine/core.py:3)" \
        in direction
    assert "runtime/ may not import ingress/: runtime.config -> ingress.shell" in direction
    assert "delta_tables/ may not import egress/" in direction
    assert "jobs/ may not import ingress/: jobs.job -> ingress.shell" in direction
    assert "egress/ may not import ingress/" in direction
    assert "ingress/ may not import relay/: ingress.shell -> relay.cli" in direction
    assert ("ingress imports egress outside the composition modules ['ingress.both']: "
            "ingress.shell -> egress.view  (ingress/shell.py:1)") in direction
    assert "ingress.both ->" not in direction

    engine = "\n".join(engine_problems(external))
    assert "engine/ imports pyarrow" in engine and "socket" not in engine

    bench = "\n".join(bench_problems(internal))
    assert "relay.up -> relay.bench.harness  (relay/up.py:2)" in bench
    assert "relay.cli -> relay.bench.run" not in bench    # lazily, from its command: fine

    found = cycle_problems(internal)
    assert any("relay.cli -> relay.up" in c and "relay.up -> relay.cli" in c for c in found)
    assert any("relay.bench.harness -> relay.bench.run" in c for c in found)
    assert any("egress.view -> ingress.shell" in c and "ingress.shell -> egress.view" in c
               for c in found)
