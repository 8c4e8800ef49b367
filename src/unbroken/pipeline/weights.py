"""The engines' weight files as the supervisor handles them: generated once for simulator
pools (cached under the cache directory), found for each pool, and pre-warmed into the page
cache before a replica starts (`unbroken prewarm` in a child process).

`readers`, when set, is told the pid of every process that reads weights (engines and the
pre-warm) as it starts: `unbroken demo` puts these, and only these, behind its storage
throttle.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.config.paths import cache_dir
from unbroken.config.spec import PoolSpec
from unbroken.pipeline.niceness import set_session_nice
from unbroken.pipeline.procs import die_with_parent

__all__ = ["PREWARM_NICE", "Weights"]

log = logging.getLogger("unbroken.pipeline")

PREWARM_NICE = 10  # the pre-warm yields the CPU to serving engines (it waits on storage)


class Weights:
    def __init__(self) -> None:
        self._generated: dict[str, Path] = {}  # simulator weights by size, once prepared
        self.readers: Callable[[int], None] | None = None

    def weights_for(self, pool: PoolSpec) -> Path | None:
        if pool.engine.kind != "simulator":
            return pool.weights
        if pool.weights is not None:
            return pool.weights
        return self._generated.get(pool.weights_size)

    def prepare(self, pools: list[PoolSpec], progress: Callable[[str], None] | None = None) -> None:
        """Generate the simulator pools' weight files once; later runs reuse the cache."""
        from unbroken.engine.weights import make_weights, parse_size

        for pool in pools:
            if pool.engine.kind != "simulator" or pool.weights is not None:
                continue
            size = pool.weights_size
            d = cache_dir() / "weights" / size.lower()
            if not (d / ".complete").exists():
                if progress:
                    progress(f"generating {size} of weights in {d} (once)")
                make_weights(d, parse_size(size))
                (d / ".complete").write_text("ok\n")
            self._generated[size] = d

    def reads(self, pid: int) -> None:
        """Process `pid` reads weights (see `readers`)."""
        if self.readers is not None:
            try:
                self.readers(pid)
            except OSError as e:  # exited already, or the cgroup is gone
                log.warning("weight reader %d: %s", pid, e)

    async def prewarm(self, pool: PoolSpec) -> dict[str, Any] | None:
        """Read the pool's weight files into the page cache before a replica starts (the
        engine then loads from memory, not from disk). None when there is nothing to read
        or the pre-warm failed (the replica then reads the disk itself; the rollout goes on).

        It runs as `unbroken prewarm` in a child process at nice PREWARM_NICE: its reader
        threads, in this process, held the GIL against the supervisor's event loop (and,
        in `unbroken demo`, the load generator's, whose clock then measured stalls that no
        engine had), and at normal priority its copies took CPU from the serving engines."""
        weights = self.weights_for(pool)
        if weights is None:
            return None
        argv = [sys.executable, "-m", "unbroken", "prewarm", "--json", str(weights)]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
            # Its own session, lowered as a whole (niceness.py): in ours, its nice value
            # ordered it only against the supervisor's own process, and the session as a
            # unit took as much CPU as a serving engine's.
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        with contextlib.suppress(OSError):  # gone already: nothing to lower
            set_session_nice(proc.pid, PREWARM_NICE)
        self.reads(proc.pid)
        try:
            out, err = await proc.communicate()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        try:
            result = json.loads(out)
        except ValueError:
            last = err.decode(errors="replace").strip().splitlines()[-1:]
            log.warning("no pre-warm for %s: %s", pool.name, *(last or [f"exit {proc.returncode}"]))
            return None
        read = result.get("read") or {}
        if proc.returncode != 0:  # read, but not all resident (memory pressure): say so
            log.warning(
                "pre-warm of %s: %.1f %% resident after the read",
                pool.name,
                result.get("residency", {}).get("percent", 0.0),
            )
        return {
            "files": len(result.get("files", [])),
            "bytes": read.get("bytes", 0),
            "seconds": round(read.get("seconds", 0.0), 3),
            "gbps": round(read.get("gbps", 0.0), 2),
        }
