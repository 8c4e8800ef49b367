"""`unbroken render k8s`: write a pipeline's objects as plain YAML, one file per object,
numbered so that `kubectl apply -f DIR` creates namespaces first. Objects of custom kinds go
to their own directories, to apply once their CRDs exist: the Prometheus Operator's to
`DIR/monitoring/`, KEDA's ScaledObjects to `DIR/keda/`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from unbroken.config.spec import PipelineSpec
from unbroken.k8s.manifests import RenderOptions, build
from unbroken.k8s.policy import check

__all__ = ["PolicyError", "render", "write"]

# Custom kinds by API group, and the directory each goes to.
CRD_DIRS = {"monitoring.coreos.com/": "monitoring", "keda.sh/": "keda"}


class PolicyError(ValueError):
    """The objects break a rule of k8s.policy; the message lists each."""


def render(spec: PipelineSpec, opts: RenderOptions) -> list[dict[str, Any]]:
    objs = build(spec, opts)
    bad = check(objs)
    if bad:
        raise PolicyError("rendered objects break policy:\n  " + "\n  ".join(bad))
    return objs


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.-]+", "-", text.lower())


def write(objs: list[dict[str, Any]], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, o in enumerate(objs):
        dirs = [d for g, d in CRD_DIRS.items() if o["apiVersion"].startswith(g)]
        sub = out / dirs[0] if dirs else out
        sub.mkdir(exist_ok=True)
        path = sub / f"{i:02d}-{_slug(o['kind'])}-{_slug(o['metadata']['name'])}.yaml"
        path.write_text(yaml.safe_dump(o, sort_keys=False, width=100))
        paths.append(path)
    return paths
