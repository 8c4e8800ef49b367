"""Build the agent's BPF objects: vmlinux.h from the running kernel's BTF (bpftool), then
clang for each `*.bpf.c` beside this package. Cached by source hash and kernel release."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["BuildError", "build_objects"]

BPF_DIR = Path(__file__).parent / "bpf"
PROGRAMS = ("cuda", "tcp")


class BuildError(RuntimeError):
    pass


def _cache() -> Path:
    base = Path(os.environ.get("UNBROKEN_CACHE_DIR", Path.home() / ".cache" / "unbroken"))
    h = hashlib.sha256(platform.release().encode())
    for f in sorted(BPF_DIR.glob("*")):
        if f.suffix in (".c", ".h"):
            h.update(f.name.encode() + f.read_bytes())
    return base / "bpf" / h.hexdigest()[:16]


def build_objects() -> dict[str, Path]:
    """Paths of the built objects by program name; builds them if needed."""
    out = _cache()
    objs = {p: out / f"{p}.bpf.o" for p in PROGRAMS}
    if all(o.exists() for o in objs.values()):
        return objs
    clang = shutil.which("clang")
    bpftool = shutil.which("bpftool") or next(
        (p for p in ("/usr/sbin/bpftool", "/sbin/bpftool") if os.path.exists(p)), None
    )
    missing = [n for n, v in (("clang", clang), ("bpftool", bpftool)) if v is None]
    if missing:
        raise BuildError(
            f"cannot build the BPF programs: {', '.join(missing)} not installed "
            "(apt-get install clang libbpf-dev bpftool)"
        )
    if not Path("/sys/kernel/btf/vmlinux").exists():
        raise BuildError("the kernel exposes no BTF (/sys/kernel/btf/vmlinux): CO-RE needs it")
    if not Path("/usr/include/bpf/bpf_helpers.h").exists():
        raise BuildError("libbpf headers missing (apt-get install libbpf-dev)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    try:
        with open(tmp / "vmlinux.h", "wb") as f:
            subprocess.run(
                [str(bpftool), "btf", "dump", "file", "/sys/kernel/btf/vmlinux", "format", "c"],
                stdout=f,
                check=True,
                stderr=subprocess.PIPE,
            )
        for p in PROGRAMS:
            r = subprocess.run(
                [
                    str(clang),
                    "-target",
                    "bpf",
                    "-D__TARGET_ARCH_x86",
                    "-O2",
                    "-g",
                    "-Wall",
                    f"-I{tmp}",
                    f"-I{BPF_DIR}",
                    "-c",
                    str(BPF_DIR / f"{p}.bpf.c"),
                    "-o",
                    str(tmp / f"{p}.bpf.o"),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if r.returncode != 0:
                raise BuildError(f"clang failed on {p}.bpf.c:\n{r.stderr}")
        try:
            tmp.rename(out)
        except OSError:
            pass  # built concurrently by another process: identical
    except subprocess.CalledProcessError as e:
        raise BuildError(f"bpftool failed: {e.stderr!r}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return objs
