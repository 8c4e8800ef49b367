"""`unbroken render k8s`: write a pipeline's objects as plain YAML, one file per object,
numbered so that `kubectl apply -f DIR` creates namespaces first. Objects of custom kinds go
to their own directories, to apply once their CRDs exist: the Prometheus Operator's to
`DIR/monitoring/`, KEDA's ScaledObjects to `DIR/keda/`.

Rendering again into the same directory replaces the previous render's files (a stale one
would be applied again by `kubectl apply -f DIR`) and keeps its admin token; a directory
holding anything else is refused, never emptied."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from unbroken.config.spec import PipelineSpec
from unbroken.k8s.manifests import MODELS_DIR, RenderOptions, build
from unbroken.k8s.policy import check

__all__ = ["PolicyError", "previous_token", "render", "vllm_cautions", "write"]

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


def _file_name(i: int, o: dict[str, Any]) -> str:
    return f"{i:02d}-{_slug(o['kind'])}-{_slug(o['metadata']['name'])}.yaml"


def _rendered(path: Path) -> dict[str, Any] | None:
    """The object in `path` if the file is one a render writes (a plain file named
    `NN-KIND-NAME.yaml` after the one object it holds), else None."""
    m = re.fullmatch(r"(\d{2,})-[a-z0-9.-]+\.yaml", path.name)
    if m is None or path.is_symlink() or not path.is_file():
        return None
    try:
        o = yaml.safe_load(path.read_text())
        ok = path.name == _file_name(int(m[1]), o)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, TypeError, KeyError):
        return None
    return o if ok else None


def previous_files(out: Path) -> list[Path]:
    """The files an earlier render left in `out`. ValueError if `out` holds anything else:
    the render replaces its own files only, so a directory of other files is refused."""
    if not out.exists():
        return []
    if not out.is_dir() or out.is_symlink():
        raise ValueError(f"--out {out}: not a directory")
    own, other = [], []
    for entry in sorted(out.iterdir()):
        if entry.name in CRD_DIRS.values() and entry.is_dir() and not entry.is_symlink():
            for f in sorted(entry.iterdir()):
                (own if _rendered(f) is not None else other).append(f)
        else:
            (own if _rendered(entry) is not None else other).append(entry)
    if other:
        shown = ", ".join(str(f) for f in other[:3]) + (", ..." if len(other) > 3 else "")
        raise ValueError(
            f"--out {out} holds files a render did not write ({shown}): the render replaces "
            "only its own files there; give a new or empty directory"
        )
    return own


def previous_token(out: Path, prefix: str = "unbroken") -> str | None:
    """The admin token of an earlier render into `out`, to render the same one again: a new
    token per render would change the Secret (and roll every pod) on each apply."""
    for path in sorted(out.glob(f"*-secret-{_slug(prefix)}-admin-token.yaml")):
        o = _rendered(path)
        if o is not None and o["kind"] == "Secret":
            token = (o.get("stringData") or {}).get("token")
            if isinstance(token, str) and token:
                return token
    return None


def write(objs: list[dict[str, Any]], out: Path) -> list[Path]:
    """One file per object; an earlier render's files in `out` are removed first."""
    if str(out) == "-":
        raise ValueError("--out -: the render writes a directory (one file per object)")
    for path in previous_files(out):
        path.unlink()
    for d in CRD_DIRS.values():
        if (out / d).is_dir() and not any((out / d).iterdir()):
            (out / d).rmdir()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, o in enumerate(objs):
        dirs = [d for g, d in CRD_DIRS.items() if o["apiVersion"].startswith(g)]
        sub = out / dirs[0] if dirs else out
        sub.mkdir(exist_ok=True)
        path = sub / _file_name(i, o)
        path.write_text(yaml.safe_dump(o, sort_keys=False, width=100))
        paths.append(path)
    return paths


def vllm_cautions(spec: PipelineSpec) -> list[str]:
    """What renders but cannot work on vLLM pods (a review of the rendered example): the
    simulator's model name given to `vllm serve`, and adapter files at a path no volume of
    the engine pod holds (vLLM loads `--lora-modules` at its start; a missing path fails it).
    A path that is not absolute is a Hugging Face repository id, which vLLM downloads."""
    out: list[str] = []
    for pool in spec.pools:
        model = pool.model_of(spec)
        if model == "unbroken-sim" and pool.weights is None:
            out.append(
                f"pool {pool.name}: `vllm serve unbroken-sim` (the simulator's model name): "
                "give the spec's or the pool's `model:` a Hugging Face id or `weights:`, or "
                "render with --engine simulator"
            )
        for a in pool.adapters:
            path = a.path or a.name
            if path.startswith("/") and not (path + "/").startswith(MODELS_DIR + "/"):
                out.append(
                    f"pool {pool.name}: adapter {a.name}'s path {path} is on no volume of the "
                    f"engine pod: put its files on the model cache volume (under {MODELS_DIR}, "
                    "e.g. a path like /models/adapters/NAME) or name a Hugging Face repository"
                )
    return out
