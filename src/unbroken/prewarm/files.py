"""Which files a path means: a file, a directory of weights, a glob, or a Hugging Face model
folder (including the hub cache layout, whose snapshot files are symlinks to blobs)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

__all__ = ["WEIGHT_SUFFIXES", "PrewarmError", "find_weight_files"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


class PrewarmError(Exception):
    """A path that cannot be pre-warmed; the message says why."""


def _weights_in(directory: Path) -> list[Path]:
    direct = [p for p in directory.iterdir() if p.suffix in WEIGHT_SUFFIXES]
    if direct:
        return direct
    # Hub cache layout (models--org--name/snapshots/<rev>/...) or nested folders.
    return [
        p
        for p in directory.rglob("*")
        if p.suffix in WEIGHT_SUFFIXES and (p.is_file() or p.is_symlink())
    ]


def find_weight_files(paths: list[str]) -> list[Path]:
    """Resolve paths to weight files (real paths, each once, in a stable order)."""
    try:
        return _find(paths)
    except PermissionError as e:
        raise PrewarmError(f"{e.filename}: permission denied") from None
    except OSError as e:
        raise PrewarmError(f"{e.filename}: {e.strerror}") from None
    except RuntimeError as e:  # Path.resolve() on a symlink loop (Python 3.11)
        raise PrewarmError(f"{e}") from None


def _find(paths: list[str]) -> list[Path]:
    if not paths:
        raise PrewarmError("no path given")
    found: list[Path] = []
    for raw in paths:
        if not raw.strip():
            raise PrewarmError("an empty path was given")
        if any(ch in raw for ch in "*?["):
            matches = [Path(m) for m in sorted(glob.glob(raw, recursive=True))]
            files = [m for m in matches if m.is_file()]
            if not files:
                raise PrewarmError(f"{raw}: the pattern matches no file")
            found += files
            continue
        p = Path(raw)
        if not p.exists():
            if p.is_symlink():
                raise PrewarmError(f"{raw}: a symlink loop or a dangling symlink")
            raise PrewarmError(f"{raw}: no such file or directory")
        if p.is_dir():
            if not os.access(p, os.R_OK | os.X_OK, effective_ids=True):
                raise PrewarmError(f"{raw}: permission denied")
            files = _weights_in(p)
            if not files:
                raise PrewarmError(
                    f"{raw}: no weight files ({', '.join(WEIGHT_SUFFIXES)}) in "
                    "this directory or below"
                )
            found += sorted(files)
        else:
            found.append(p)
    out: list[Path] = []
    seen: set[Path] = set()
    for f in found:
        real = f.resolve()
        if real in seen:
            continue
        if not os.access(real, os.R_OK, effective_ids=True):
            raise PrewarmError(f"{f}: permission denied")
        if not real.is_file():
            raise PrewarmError(f"{f}: not a regular file")
        seen.add(real)
        out.append(real)
    return out
