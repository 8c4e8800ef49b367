"""`unbroken up` and `unbroken status`: the human side of the supervisor."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from unbroken.clients import AdminError
from unbroken.config.spec import SpecError, load_spec
from unbroken.pipeline.paths import RunInfo, admin_token, state_dir
from unbroken.pipeline.supervisor import StartupError, Supervisor

__all__ = ["run_up", "show_status"]


def run_up(
    spec_path: Path | None, *, port: int | None, admin_port: int | None, console: Console
) -> int:
    try:
        spec = load_spec(spec_path)
    except SpecError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    if port is not None:
        spec.gateway.port = port
    if admin_port is not None:
        spec.gateway.admin_port = admin_port
    state = state_dir()
    running = RunInfo.read(state)
    if running is not None:
        console.print(
            f"[red]error:[/red] a pipeline is already running (pid {running.pid}, "
            f"{running.gateway_url}); see `unbroken status`"
        )
        return 1
    token, token_file, generated = admin_token(state)
    if generated:
        console.print(f"admin token (also in {token_file}, mode 600): [bold]{token}[/bold]")
    sup = Supervisor(spec, state=state, token=token, token_file=token_file)
    return asyncio.run(_main(sup, console))


async def _main(sup: Supervisor, console: Console) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    try:
        with console.status("starting") as st:
            starting = asyncio.create_task(sup.start(lambda m: st.update(m)))
            waiter = asyncio.create_task(stop.wait())
            await asyncio.wait({starting, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                starting.cancel()
                console.print("interrupted during start-up")
                return 130
            waiter.cancel()
            starting.result()
        console.print(_table(await sup.status()))
        console.print(
            f"gateway: [bold]{sup.gateway_url}/v1[/bold]   admin: {sup.admin_url} "
            f"(bearer token in {sup.token_file})   logs: {sup.logs}"
        )
        console.print("Ctrl-C to stop")
        await stop.wait()
        console.print("stopping")
    except (StartupError, AdminError) as e:
        console.print(f"[red]error:[/red] {e}")
        code = 1
    finally:
        await sup.stop()
    return code


def _table(status: dict[str, Any]) -> Table:
    eps = {e["name"]: e for e in (status.get("gateway") or {}).get("endpoints", [])}
    t = Table(title="unbroken pipeline")
    for col in ("pool", "endpoint", "url", "pid", "state", "healthy", "in-flight", "start→health"):
        t.add_column(col)
    names = [r["name"] for r in status["replicas"]] + [
        n for n in eps if n not in {r["name"] for r in status["replicas"]}
    ]
    reps = {r["name"]: r for r in status["replicas"]}
    for name in sorted(names):
        r, e = reps.get(name, {}), eps.get(name, {})
        sth = r.get("start_to_health_s")
        t.add_row(
            e.get("pool") or r.get("pool", "?"),
            name,
            e.get("url") or r.get("url", ""),
            str(r.get("pid") or "-"),
            e.get("state", "unregistered"),
            "yes" if e.get("healthy") else "no",
            f"{e.get('inflight', 0)}/{e.get('cap', '-')}",
            f"{sth:.2f} s" if sth is not None else "-",
        )
    return t


def show_status(*, as_json: bool) -> int:
    console = Console()
    info = RunInfo.read(state_dir())
    if info is None:
        Console(stderr=True).print("no pipeline is running (start one with `unbroken up`)")
        return 1

    async def fetch() -> dict[str, Any]:
        conn = aiohttp.UnixConnector(path=info.control_socket)
        async with (
            aiohttp.ClientSession(connector=conn) as s,
            s.get("http://supervisor/status", timeout=aiohttp.ClientTimeout(total=10)) as r,
        ):
            return await r.json()

    try:
        status = asyncio.run(fetch())
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        Console(stderr=True).print(f"[red]error:[/red] cannot reach the supervisor: {e}")
        return 1
    if as_json:
        sys.stdout.write(json.dumps(status, indent=1) + "\n")
        return 0
    console.print(_table(status))
    gw = status.get("gateway") or {}
    console.print(
        f"gateway {status['gateway_url']}  queue {gw.get('queue', {})}  "
        f"restarts {status.get('restarts', 0)}"
    )
    return 0
