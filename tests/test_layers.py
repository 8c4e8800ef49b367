"""The layering in DESIGN.md, enforced: outer layers may import inner ones, never the reverse;
components (engine, gateway, agent, prewarm) never import each other's internals."""

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


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for n in names:
            parts = n.split(".")
            if parts[0] == "unbroken" and len(parts) > 1:
                out.add(parts[1])
    return out


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
