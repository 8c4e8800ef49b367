"""The processes that run beside a local pipeline's engines and gateway: the node agent (as
root, unless the spec disables it) and the controller. Each is restarted with backoff if it
dies; neither is needed for serving, so a failure is logged and never stops the pipeline."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from unbroken.config.paths import engine_token_path
from unbroken.config.spec import PipelineSpec
from unbroken.engine.profiles import get_profile

__all__ = ["FULL_PRECISIONS", "Companion", "Companions", "controller_settings"]

log = logging.getLogger("unbroken.pipeline")

FULL_PRECISIONS = ("fp16", "bf16")
STOP_TIMEOUT_S = 5.0  # after SIGTERM, before SIGKILL

Spawn = Callable[
    [str, list[str], dict[str, str] | None], Awaitable[tuple[asyncio.subprocess.Process, Path]]
]


def controller_settings(spec: PipelineSpec, state: Path | None = None) -> dict[str, Any]:
    """The spec's controller section with tiers filled in from pool precisions when unset;
    each simulator pool's configured max_num_seqs (what a lowered engine is restored to,
    also by a restarted controller); and, with the state directory, the controller's state
    file (baselines and lowered engines survive a restart of the controller)."""
    s = spec.controller.model_dump()
    # A tier set in the spec wins: the derived one never names a pool it has.
    full, degraded = list(s["full_pools"]), list(s["degraded_pools"])
    if not full:
        s["full_pools"] = [
            p.name for p in spec.pools if p.precision in FULL_PRECISIONS and p.name not in degraded
        ]
    if not degraded:
        s["degraded_pools"] = [
            p.name for p in spec.pools if p.precision not in FULL_PRECISIONS and p.name not in full
        ]
    seqs = dict(s["engine_max_num_seqs"])
    for p in spec.pools:
        e = p.engine
        if e.kind == "simulator" and p.name not in seqs:
            seqs[p.name] = e.overrides.max_num_seqs or get_profile(e.profile).max_num_seqs
    s["engine_max_num_seqs"] = seqs
    if state is not None and not s["state_file"]:
        s["state_file"] = str(state / "controller-state.json")
    return s


def agent_wanted(spec: PipelineSpec) -> tuple[bool, str]:
    enabled = spec.agent.enabled
    if enabled is False:
        return False, "disabled (--no-agent, or agent.enabled: false in the spec)"
    if os.geteuid() != 0:
        if enabled is True:
            return False, "the spec enables it but eBPF needs root; not started"
        return False, "not root: no eBPF agent (the controller uses engine signals)"
    if not Path("/sys/kernel/btf/vmlinux").exists():
        return False, "no kernel BTF: no eBPF agent (the controller uses engine signals)"
    return True, ""


class Companion:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], url: str) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.url = url
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.task: asyncio.Task[None] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "pid": self.proc.pid if self.proc and self.proc.returncode is None else None,
            "restarts": self.restarts,
        }


class Companions:
    def __init__(self, spec: PipelineSpec, state: Path, admin_url: str, token: str) -> None:
        self.spec = spec
        self.state = state
        self.admin_url = admin_url
        self.token = token
        self.items: dict[str, Companion] = {}
        self.agent_note = ""
        self._stopping = False

    def plan(self) -> list[Companion]:
        py = [sys.executable, "-m", "unbroken"]
        env = {"UNBROKEN_STATE_DIR": str(self.state), "UNBROKEN_ADMIN_TOKEN": self.token}
        out: list[Companion] = []
        agent_url: str | None = None
        want, why = agent_wanted(self.spec)
        self.agent_note = why
        if want:
            a = self.spec.agent
            agent_url = f"http://{a.host}:{a.port}"
            argv = [*py, "agent", "--listen", f"{a.host}:{a.port}"]
            out.append(Companion("agent", argv, env, agent_url))
        c = self.spec.controller
        if c.enabled:
            cfg = self.state / "controller.json"
            cfg.write_text(json.dumps(controller_settings(self.spec, self.state), indent=1))
            argv = [*py, "controller", "--gateway-admin", self.admin_url, "--config", str(cfg),
                    "--supervisor-socket", str(self.state / "supervisor.sock")]  # fmt: skip
            if agent_url:
                argv += ["--agent", agent_url]
            if (tok := engine_token_path(self.state)).exists():  # the engines' own admin token
                argv += ["--engine-token-file", str(tok)]
            out.append(Companion("controller", argv, env, f"http://{c.host}:{c.port}"))
        return out

    async def start(self, spawn: Spawn, say: Callable[[str], None]) -> None:
        for comp in self.plan():
            self.items[comp.name] = comp
            comp.task = asyncio.create_task(self._keep(comp, spawn), name=f"keep-{comp.name}")
        if self.agent_note:
            say(f"agent: {self.agent_note}")
        if self.items:
            say("started " + " and ".join(self.items))

    async def _keep(self, comp: Companion, spawn: Spawn) -> None:
        backoff = 1.0
        while not self._stopping:
            t0 = time.monotonic()
            try:
                comp.proc, path = await spawn(comp.name, comp.argv, comp.env)
            except OSError as e:
                log.error("could not start the %s: %s", comp.name, e)
                return
            code = await comp.proc.wait()
            if self._stopping:
                return
            if time.monotonic() - t0 > 60:
                backoff = 1.0
            log.warning(
                "the %s exited with %s (log: %s); restarting in %.0f s",
                comp.name,
                code,
                path,
                backoff,
            )
            comp.restarts += 1
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    async def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: c.as_dict() for name, c in self.items.items()}
        if "agent" not in out:
            out["agent"] = {"url": None, "pid": None, "note": self.agent_note}
        ctl = self.items.get("controller")
        if ctl is not None:
            try:
                async with (
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as s,
                    s.get(ctl.url + "/health") as r,
                ):
                    h = await r.json()
                out["controller"]["live"] = True
                out["agent"]["signals"] = h.get("agent")
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
                out["controller"]["live"] = False
        return out

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM every companion at once and wait for them together (in turn, each had
        its own 5 s: `unbroken down` paid the sum); SIGKILL what is left after `timeout`.
        How long each took is logged, and a kill as a warning."""
        self._stopping = True
        t0 = time.monotonic()

        async def one(c: Companion) -> None:
            p = c.proc
            if p is None or p.returncode is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(p.wait(), timeout)
            except TimeoutError:
                log.warning("the %s did not exit %g s after SIGTERM: killed", c.name, timeout)
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
            log.info("%s stopped in %.1f s", c.name, time.monotonic() - t0)

        for c in self.items.values():
            if c.task is not None:
                c.task.cancel()
        await asyncio.gather(*(one(c) for c in self.items.values()))
