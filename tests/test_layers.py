"""The layering in DESIGN.md and docs/architecture.md, enforced: outer layers may import inner
ones, never the reverse; components (engine, gateway, agent, prewarm) never import each other's
internals. Within the packages that are assembled from parts (the CLI, the controller, the
report), the parts never import what assembles them, the CLI's command modules import their
components only when a command runs, and the controller's judgement stays free of I/O."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parent.parent / "src" / "unbroken"

# package → the unbroken packages it may import (besides itself)
ALLOWED = {
    "wire": set(),
    "config": set(),
    "clients": {"wire"},
    "engine": {"wire", "config"},
    "gateway": {"wire", "config", "k8s"},  # k8s: EndpointSlice discovery (gateway/_discovery)
    "agent": {"wire", "config"},
    "prewarm": set(),
    "k8s": {"wire", "config"},  # the one place that imports lightkube
    "controller": {"wire", "config", "clients", "k8s"},
    "pipeline": {"wire", "config", "clients", "engine", "prewarm"},
    "bench": {"wire", "config", "clients", "engine", "prewarm", "pipeline"},
    "cli": {
        "wire",
        "config",
        "clients",
        "engine",
        "gateway",
        "agent",
        "prewarm",
        "pipeline",
        "bench",
        "controller",
        "k8s",
    },
}


def _package(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py") if rel.parts[0] != "__main__.py" else "cli"


def _modules(nodes: list[ast.stmt] | ast.AST) -> set[str]:
    """Absolute module names imported by `nodes` (a tree: every import in it)."""
    out = set()
    for node in ast.walk(nodes) if isinstance(nodes, ast.AST) else nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _imports(path: Path) -> set[str]:
    out = set()
    for n in _modules(ast.parse(path.read_text())):
        parts = n.split(".")
        if parts[0] == "unbroken" and len(parts) > 1:
            out.add(parts[1])
    return out


def _top_level_imports(path: Path) -> set[str]:
    """What importing the module imports: its module-level statements, `if TYPE_CHECKING:`
    blocks left out, imports inside functions (run later, if at all) left out."""
    body: list[ast.stmt] = []
    stack = list(ast.parse(path.read_text()).body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                stack += node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody
            stack += [s for h in node.handlers for s in h.body]
        else:
            body.append(node)
    return _modules(body)


def _rel(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def test_layers() -> None:
    bad = []
    files = [p for p in SRC.rglob("*.py") if p.name != "__init__.py" or p.parent != SRC]
    for path in files:
        pkg = _package(path)
        if pkg not in ALLOWED:
            continue
        for dep in _imports(path) - {pkg}:
            if dep not in ALLOWED[pkg]:
                bad.append(f"{path.relative_to(SRC)} imports unbroken.{dep}")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_every_package_is_placed() -> None:
    pkgs = {
        p.name.removesuffix(".py")
        for p in SRC.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))
    }
    assert pkgs <= set(ALLOWED), pkgs - set(ALLOWED)


def test_only_the_cli_imports_typer() -> None:
    """Components are run through `run()`-style functions: the front end stays in cli/."""
    bad = [
        _rel(p)
        for p in SRC.rglob("*.py")
        if not _rel(p).startswith("cli/")
        and any(m.split(".")[0] == "typer" for m in _modules(ast.parse(p.read_text())))
    ]
    assert not bad, bad


def test_cli_commands_import_their_components_when_they_run() -> None:
    """Importing the CLI registers every command; a command module that imported its
    component at module level would make every command (the engine's start, `--help`) pay
    for every component. Only the shared `cli.common` is imported up front."""
    bad = []
    for p in sorted((SRC / "cli").glob("*.py")):
        for m in _top_level_imports(p):
            if m.startswith("unbroken") and m != "unbroken.cli.common":
                bad.append(f"{_rel(p)} imports {m} at module level")
    assert not bad, "\n".join(bad)


# package directory → the modules that assemble it from its parts (and may import them all)
ASSEMBLED = {
    "cli": {"__init__.py"},
    "controller": {"__init__.py", "service.py"},
    "bench/report": {"__init__.py"},
}


def test_parts_do_not_import_what_assembles_them() -> None:
    """The parts of the CLI, the controller and the report stand on their own: none imports
    its package's assembly at module level (`controller.api` imports `Controller` inside
    `serve`, since `service` re-exports `serve`)."""
    bad = []
    for pkg, assemblers in ASSEMBLED.items():
        dotted = "unbroken." + pkg.replace("/", ".")
        banned = {dotted} | {f"{dotted}.{a.removesuffix('.py')}" for a in assemblers}
        banned.discard(f"{dotted}.__init__")
        for p in sorted((SRC / pkg).glob("*.py")):
            if p.name in assemblers:
                continue
            for m in _top_level_imports(p) & banned:
                bad.append(f"{_rel(p)} imports {m}")
    assert not bad, "\n".join(bad)


# The controller's judgement (signals, classification, actions): pure functions of what was
# read, testable in process; the reads are in sensing.py and the writes in reconcile.py.
PURE = ("controller/signals.py", "controller/classify.py", "controller/actions.py")


def test_the_controllers_judgement_does_no_io() -> None:
    io = {"aiohttp", "httpx", "socket", "unbroken.clients"}
    bad = []
    for rel in PURE:
        for m in _modules(ast.parse((SRC / rel).read_text())):
            if m in io or m.split(".")[0] in io:
                bad.append(f"{rel} imports {m}")
    assert not bad, "\n".join(bad)
