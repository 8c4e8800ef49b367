"""The gateway package is a one-way stack: no module imports one that imports it back
(directly or through others), counting every import: at module level, inside a function,
and under `if TYPE_CHECKING:` (annotations only). A cycle makes the import order matter and
hides which module is the lower layer, so a newcomer cannot read the package bottom-up; an
annotation-only cycle does the second as much as a runtime one. Two tests: runtime imports
(a cycle there can break the import itself), and all imports; each names the cycle it
finds."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

GATEWAY = Path(__file__).parent.parent / "src" / "unbroken" / "gateway"
PACKAGE = "unbroken.gateway"


def runtime_imports(tree: ast.AST) -> set[str]:
    """Absolute module names `tree` imports at run time (`if TYPE_CHECKING:` blocks left
    out, their `else:` kept; `from unbroken.gateway import _x` counts as `_x`)."""
    out: set[str] = set()

    def walk(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for n in node.orelse:
                walk(n)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            if node.module == PACKAGE:
                out.update(f"{PACKAGE}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            walk(child)

    walk(tree)
    return out


def all_imports(tree: ast.AST) -> set[str]:
    """Absolute module names `tree` imports anywhere, `if TYPE_CHECKING:` blocks included."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            if node.module == PACKAGE:
                out.update(f"{PACKAGE}.{a.name}" for a in node.names)
    return out


# Annotation-only edges that still close a cycle, each to be removed here once its module
# no longer needs it: the test fails while one is listed but gone, so the list cannot go
# stale. `_latency` names `_pool.Endpoint` and `PickRequest` for its annotations while
# `_pool` imports `_latency` (the default policy): it is to take `PickRequest` from
# `_policy` and read endpoints through a protocol of its own, as `_adapters` does.
PENDING: set[tuple[str, str]] = set()


def graph(imports: Callable[[ast.AST], set[str]] = runtime_imports) -> dict[str, set[str]]:
    """Module (file stem) → the gateway modules it imports (by `imports`: at run time, or
    all of them)."""
    mods = {p.stem: p for p in GATEWAY.glob("*.py")}
    g: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for imp in imports(ast.parse(path.read_text())):
            parts = imp.split(".")
            if imp.startswith(PACKAGE + ".") and parts[2] in mods and parts[2] != name:
                deps.add(parts[2])
        g[name] = deps
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle_and_skips_type_checking() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "from unbroken.gateway._pool import Endpoint\n"
        "if TYPE_CHECKING:\n"
        "    from unbroken.gateway._server import Gateway\n"
        "def f():\n"
        "    from unbroken.gateway import _main\n"
    )
    found = runtime_imports(tree)
    assert "unbroken.gateway._pool" in found and "unbroken.gateway._main" in found
    assert "unbroken.gateway._server" not in found
    assert "unbroken.gateway._server" in all_imports(tree) and found <= all_imports(tree)


def fail_on_cycles(g: dict[str, set[str]], what: str) -> None:
    found = cycles(g)
    if found:
        edges = {
            " ".join(scc): sorted(f"{a}->{b}" for a in scc for b in g[a] if b in scc)
            for scc in found
        }
        pytest.fail(f"{what} import cycles in the gateway: {edges}")


def test_no_runtime_import_cycle_in_the_gateway() -> None:
    g = graph()
    assert len(g) > 20, "the gateway's modules were not found"
    fail_on_cycles(g, "runtime")


def test_no_import_cycle_in_the_gateway_counting_annotations() -> None:
    g = graph(all_imports)
    assert len(g) > 20, "the gateway's modules were not found"
    for a, b in sorted(PENDING):
        assert b in g.get(a, set()), f"{a} no longer imports {b}: remove it from PENDING"
        g[a].discard(b)
    fail_on_cycles(g, "annotation-only or runtime")


def test_the_relays_layers_keep_slots() -> None:
    """`StreamRelay` is a stack of classes in several modules (`_stream_state` at the bottom,
    `_stream` on top); one without `__slots__` would give every relay a `__dict__` (memory
    per stream, and a dict probe in the per-chunk path's method lookups)."""
    from unbroken.gateway._stream import StreamRelay

    for cls in StreamRelay.__mro__[:-1]:
        assert "__slots__" in cls.__dict__, f"{cls.__qualname__} has no __slots__"
    assert "__dict__" not in dir(StreamRelay)


# Names `_stream`, `_metrics`, `_transform` and `_admission` defined before their split
# (issue 22), importable from there until every caller imports them from their new modules
# (then this list goes).
MOVED = {
    "_stream": [
        "RelayHost",
        "SNAPSHOT_VERSION",
        "HANDOVER",
        "STALL_LEARN",
        "_DYING",
        "_MAX_SPLIT_BACK",
        "log",
    ],
    "_metrics": [
        "FastHistogram",
        "_HistChild",
        "_PoolCollector",
        "_PrefixCollector",
        "PER_WORKER_GAUGES",
        "merge_expositions",
        "retire",
        "_Families",
        "_SUMMED",
        "_add",
        "_render",
    ],
    "_transform": [
        "_Usage",
        "_Delta",
        "_TextChoice",
        "_ChatChoice",
        "_TextChunk",
        "_ChatChunk",
        "_TEXT",
        "_CHAT",
        "_IDS",
        "_USAGE",
        "_raw",
        "_strip",
        "_has_text",
        "_is_chunk",
    ],
    "_admission": [
        "PRIORITIES",
        "_RANK",
        "_Kind",
        "_Waiter",
    ],
}


@pytest.mark.parametrize("module", sorted(MOVED))
def test_moved_names_still_import_from_their_old_module(module: str) -> None:
    import importlib

    mod = importlib.import_module(f"{PACKAGE}.{module}")
    missing = [n for n in MOVED[module] if not hasattr(mod, n)]
    assert not missing, f"{module} no longer has {missing}"
