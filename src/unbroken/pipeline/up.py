"""`unbroken up`, `unbroken status`, `unbroken rollout`, `unbroken reload`: the human side of
the supervisor."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from unbroken.clients import AdminError
from unbroken.config.paths import RunInfo, admin_token, ensure_state_dir, state_dir
from unbroken.config.spec import PipelineSpec, SpecError, load_spec
from unbroken.pipeline.control import (
    SupervisorClient,
    SupervisorError,
    SupervisorRejected,
    SupervisorUnreachable,
)
from unbroken.pipeline.replicas import serial_of
from unbroken.pipeline.supervisor import (
    StartupError,
    Supervisor,
    describe_engine,
    live_plane,
    stop_plane,
)
from unbroken.pipeline.targets import JOBS, keep_targets, write_targets

__all__ = ["down_cli", "reload_cli", "run_up", "scale_cli", "show_status"]

log = logging.getLogger("unbroken.pipeline")


def run_up(
    spec_path: Path | None,
    *,
    port: int | None,
    admin_port: int | None,
    console: Console,
    controller_port: int | None = None,
    agent_port: int | None = None,
    agent: bool | None = None,
) -> int:
    try:
        spec = load_spec(spec_path)
    except SpecError as e:
        console.print(f"[red]error:[/red] {escape(str(e))}")
        return 2
    for flag, value in (("--port", port), ("--admin-port", admin_port)):
        if value is not None and not 0 <= value <= 65535:
            console.print(f"error: {flag} {value}: a port is 0..65535", markup=False)
            return 2
    flags = {
        "port": port,
        "admin_port": admin_port,
        "controller_port": controller_port,
        "agent_port": agent_port,
        "agent": agent,
    }
    _apply_flags(spec, **flags)
    # A pool that may sleep (replicas: {min: 0, ...}) wakes on demand: not a warning.
    empty = [p.name for p in spec.pools if p.replicas == 0 and p.autoscale is None]
    if empty and len(empty) == len(spec.pools):
        console.print(
            "warning: every pool has 0 replicas: the gateway will answer 503 to every "
            "request until engines are added",
            markup=False,
        )
    elif empty:
        console.print(f"warning: pool(s) with 0 replicas: {', '.join(empty)}", markup=False)
    state = state_dir()
    running = RunInfo.read(state)
    if running is not None:
        console.print(
            f"[red]error:[/red] a pipeline is already running with the state directory "
            f"{escape(str(state))} (pid {running.pid}, {running.gateway_url}); see `unbroken "
            "status`, stop it with `unbroken down`, or set UNBROKEN_STATE_DIR to another "
            "directory to run a second one"
        )
        return 1
    _log_to_file(state)
    token, token_file, generated = admin_token(state)
    if generated:
        console.print(f"admin token generated: {token_file} (mode 600)", markup=False)
    path = spec_path.absolute() if spec_path is not None else None

    def reread() -> PipelineSpec:  # `unbroken reload`: the same file, the same flags
        again = load_spec(path)
        _apply_flags(again, **flags)
        return again

    sup = Supervisor(
        spec,
        state=state,
        token=token,
        token_file=token_file,
        spec_path=path,
        reload_spec=reread,
        survive=True,
    )
    return asyncio.run(_main(sup, console))


def _log_to_file(state: Path) -> Path:
    """The supervisor's log (every `unbroken.*` logger of this process) also goes to
    STATE/logs/supervisor.log (0600), beside the gateway's and the engines': `up`'s own
    output is lost with its terminal, and a post-mortem needs the timeline."""
    logs = ensure_state_dir(state) / "logs"
    logs.mkdir(exist_ok=True, mode=0o700)
    path = logs / "supervisor.log"
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("unbroken").addHandler(handler)
    log.info("unbroken up (pid %d) with the state directory %s", os.getpid(), state)
    return path


def _apply_flags(
    spec: PipelineSpec,
    *,
    port: int | None,
    admin_port: int | None,
    controller_port: int | None,
    agent_port: int | None,
    agent: bool | None,
) -> None:
    """`unbroken up`'s flags override the spec, at start and when a reload reads it again."""
    if port is not None:
        spec.gateway.port = port
    if admin_port is not None:
        spec.gateway.admin_port = admin_port
    if controller_port is not None:
        spec.controller.port = controller_port
    if agent_port is not None:
        spec.agent.port = agent_port
    if agent is not None:
        spec.agent.enabled = agent


async def _main(sup: Supervisor, console: Console) -> int:
    stop = asyncio.Event()
    serving = False
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def hup() -> None:
        """SIGHUP is a reload (`unbroken reload`'s path), never the default death."""
        if not serving:
            log.warning("SIGHUP during start-up: ignored (send it again once it serves)")
            return
        sup.track(asyncio.create_task(sup.reload_on_hup(), name="sighup-reload"))

    loop.add_signal_handler(signal.SIGHUP, hup)
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
        serving = True
        targets = asyncio.create_task(keep_targets(sup, sup.state / "prometheus"))
        status = await sup.status()
        width = console.width if console.is_terminal else None
        console.print(
            render_table(status_rows(status), STATUS_COLUMNS, width), markup=False, highlight=False
        )
        console.print(
            f"gateway: {sup.gateway_url}/v1   admin: {sup.admin_url} "
            f"(bearer token in {sup.token_file})   logs: {sup.logs} "
            "(the supervisor's: supervisor.log)",
            markup=False,
        )
        log.info(
            "serving: gateway %s/v1 (pid %s), %d engine replica(s)",
            sup.gateway_url,
            status.get("gateway_pid"),
            len(status.get("replicas") or []),
        )
        console.print(
            f"prometheus file_sd targets: {sup.state / 'prometheus'}/*.json", markup=False
        )
        console.print("Ctrl-C to stop")
        ended = asyncio.create_task(sup.stopped.wait())  # the gateway was stopped (exit 0)
        await asyncio.wait(
            {asyncio.create_task(stop.wait()), ended}, return_when=asyncio.FIRST_COMPLETED
        )
        why = "" if not ended.done() else "the gateway stopped; "
        console.print(f"{why}stopping")
        log.info("%sstopping", why or "SIGINT or SIGTERM (Ctrl-C, `unbroken down`): ")
        targets.cancel()
    except (StartupError, AdminError) as e:
        console.print(f"[red]error:[/red] {escape(str(e))}")
        code = 1
    finally:
        t0 = time.monotonic()
        await sup.stop()
        prom = sup.state / "prometheus"
        if prom.exists():  # a stopped pipeline has nothing to scrape (not "down" targets)
            write_targets(prom, {j: [] for j in JOBS})
        console.print(f"stopped in {time.monotonic() - t0:.1f} s", markup=False)
        log.info("stopped in %.1f s", time.monotonic() - t0)
    return code


STATUS_COLUMNS = (
    "pool",
    "endpoint",
    "url",
    "pid",
    "state",
    "condition",
    "healthy",
    "in-flight",
    "start→health",
)
# Dropped in this order when a terminal is too narrow; endpoint and url never are, and
# nothing is ever cut: `unbroken drain NAME` and `grep` need whole names.
DROPPABLE = ("start→health", "pid", "healthy", "pool", "condition")


def _unregistered(replica: dict[str, Any]) -> str:
    return "starting" if replica.get("state") == "starting" else "unregistered"


def status_rows(status: dict[str, Any]) -> list[dict[str, str]]:
    """One row per endpoint or replica, every column as text."""
    eps = {e["name"]: e for e in (status.get("gateway") or {}).get("endpoints", [])}
    reps = {r["name"]: r for r in status.get("replicas", [])}
    rows = []
    for name in sorted(set(eps) | set(reps)):
        r, e = reps.get(name, {}), eps.get(name, {})
        sth = r.get("start_to_health_s")
        rows.append(
            {
                "pool": str(e.get("pool") or r.get("pool", "?")),
                "endpoint": name,
                "url": str(e.get("url") or r.get("url", "")),
                "pid": str(r.get("pid") or "-"),
                # Not in the gateway (yet): a replica still before /health says so.
                "state": str(e.get("state") or _unregistered(r)),
                "condition": str(e.get("condition") or "-"),
                "healthy": "yes" if e.get("healthy") else "no",
                "in-flight": f"{e.get('inflight', 0)}/{e.get('cap', '-')}",
                "start→health": f"{sth:.2f} s" if sth is not None else "-",
            }
        )
    # A declared pool with no endpoint and no replica (its only replica in a replacement
    # crash loop, or scaled to 0) keeps a row: it vanished from the table before.
    shown = {r["pool"] for r in rows}
    for name, p in (status.get("pools") or {}).items():
        if name in shown:
            continue
        replacing = _replacing(status, name)
        rows.append(
            {
                "pool": name,
                "endpoint": "-",
                "url": "-",
                "pid": "-",
                "state": "replacing" if replacing else f"{p.get('live', 0)}/{p['declared']} live",
                "condition": "-",
                "healthy": "no" if p["declared"] else "-",
                "in-flight": "-",
                "start→health": "-",
            }
        )
    return rows


def _replacing(status: dict[str, Any], pool: str) -> dict[str, str]:
    """The replacements under way of `pool`'s replicas (named POOL-N): name → last failure."""
    return {
        name: why
        for name, why in (status.get("replacing") or {}).items()
        if serial_of(name, pool) is not None
    }


def pool_lines(status: dict[str, Any]) -> list[str]:
    """One line per declared pool, `live/declared`, with the last replacement failure of a
    pool below its size (kubectl's READY 0/1, systemd's auto-restart)."""
    out = []
    for name, p in (status.get("pools") or {}).items():
        live, declared = p.get("live", 0), p.get("declared", 0)
        line = f"pool {name}: {live}/{declared} live"
        if live < declared:
            line += f", {declared - live} missing"
            for old, why in _replacing(status, name).items():
                line += f"; replacing {old}, last failure: {why}"
        out.append(line)
    return out


def render_table(rows: list[dict[str, str]], columns: tuple[str, ...], width: int | None) -> str:
    """Plain aligned text. With a `width` (a terminal), less important columns are dropped
    until the lines fit; names and URLs are never shortened."""
    cols = list(columns)

    def widths() -> dict[str, int]:
        return {c: max([len(c), *(len(r[c]) for r in rows)]) for c in cols}

    if width is not None:
        for c in DROPPABLE:
            if sum(widths().values()) + 2 * (len(cols) - 1) <= width:
                break
            if c in cols:
                cols.remove(c)
    w = widths()
    lines = ["  ".join(c.ljust(w[c]) for c in cols).rstrip()]
    lines += ["  ".join(r[c].ljust(w[c]) for c in cols).rstrip() for r in rows]
    return "\n".join(lines)


def status_lines(status: dict[str, Any]) -> list[str]:
    """The lines under the table: gateway (and its restarts), each pool's live/declared,
    replica replacements, queue, autoscaling, agent and controller."""
    gw = status.get("gateway") or {}
    queue = gw.get("queue") or {}
    q = ", ".join(f"{k} {v}" for k, v in queue.items()) or "-"
    url = status.get("gateway_url")
    rep = status.get("replacements") or {}
    out = [  # as `unbroken up` prints them
        f"gateway: {url + '/v1' if url else '-'}   admin: {status.get('admin_url', '-')}   "
        f"gateway restarts: {status.get('gateway_restarts', 0)}",
        *pool_lines(status),
        f"replica replacements: {rep.get('attempts', 0)} attempt(s), {rep.get('failed', 0)} failed",
        f"queue: {q}",
    ]
    if gw.get("error"):
        out.append(f"gateway admin API: {gw['error']}")
    events = status.get("events") or []
    for name, p in (status.get("pools") or {}).items():
        if "min" not in p:
            continue
        line = (
            f"autoscale {name}: {p['live']} live, {p.get('wanted', p['declared'])} wanted, "
            f"in [{p['min']}, {p['max']}]"
        )
        if p.get("scaling"):
            line += f"; resizing {p['scaling']}"
        last = next(
            (
                e
                for e in reversed(events)
                if e.get("event") == "scale_started" and e.get("pool") == name
            ),
            None,
        )
        if last is not None:
            ago = max(0.0, time.time() - float(last.get("t", 0)))
            line += (
                f"; last {last.get('replicas')} -> {last.get('to')} {ago:.0f} s ago "
                f"({last.get('reason')})"
            )
        out.append(line)
    for part in ("agent", "controller"):
        info = status.get(part)
        if info is not None:
            out.append(f"{part}: {_companion(info)}")
    return out


def _companion(info: Any) -> str:
    """agent/controller as `unbroken up` reports them: running or not, and for the agent
    whether the controller reads live signals from it."""
    if not isinstance(info, dict):
        return str(info)
    if info.get("pid"):
        head = f"running (pid {info['pid']}, {info.get('url')}"
        head += f", restarts {info['restarts']})" if info.get("restarts") else ")"
    else:
        head = "not running" + (f": {info['note']}" if info.get("note") else "")
    parts = [head]
    if "live" in info:
        parts.append("answering" if info["live"] else "NOT answering")
    if info.get("signals") is not None:
        parts.append(f"signals {info['signals']}")
    shown = {"pid", "url", "restarts", "note", "live", "signals"}
    parts += [
        f"{k} {v}" for k, v in info.items() if k not in shown and not isinstance(v, dict | list)
    ]
    return "; ".join(parts)


def _table(status: dict[str, Any]) -> str:
    return render_table(status_rows(status), STATUS_COLUMNS, None)


def show_status(*, as_json: bool) -> int:
    info = RunInfo.read(state_dir())
    status: dict[str, Any] | None = None
    if info is not None:
        try:
            status = asyncio.run(SupervisorClient(info.control_socket).status())
        except SupervisorUnreachable as e:
            if not e.refused:
                return _status_error(str(e), as_json)
            info = None  # nothing listens: it died (run.json outlives a SIGKILL)
        except SupervisorError as e:
            return _status_error(str(e), as_json)
    if info is None and (orphan := _orphan(state_dir())) is not None:
        gw = orphan["gateway"]
        engines = [r for r in orphan.get("replicas", []) if r["alive"]]
        if as_json:
            out = {"running": False, "supervisor": "not running", "data_plane": "serving",
                   "state_dir": str(state_dir()), "gateway_pid": gw["pid"],
                   "gateway_url": gw.get("url"), "admin_url": gw.get("admin_url"),
                   "replicas": [{k: r[k] for k in ("name", "pool", "pid", "port")}
                                for r in engines]}  # fmt: skip
            sys.stdout.write(json.dumps(out, indent=1) + "\n")
        else:
            sys.stderr.write(
                f"supervisor not running, data plane serving: gateway pid {gw['pid']} "
                f"({gw.get('url')}), {len(engines)} engine(s): "
                + ", ".join(f"{r['name']} pid {r['pid']}" for r in engines)
                + "\n`unbroken up` with this state directory takes it back; `unbroken down` "
                "stops it\n"
            )
        return 1
    if info is None:
        msg = no_supervisor()  # "no pipeline is running in STATE_DIR (start one ...)"
        if as_json:
            sys.stdout.write(
                json.dumps({"running": False, "error": msg, "state_dir": str(state_dir())}) + "\n"
            )
        else:
            sys.stderr.write(msg + "\n")
        return 1

    assert status is not None
    if as_json:
        sys.stdout.write(json.dumps({"running": True, **status}, indent=1) + "\n")
        return 0
    tty = sys.stdout.isatty()
    width = shutil.get_terminal_size().columns if tty else None
    sys.stdout.write(render_table(status_rows(status), STATUS_COLUMNS, width) + "\n")
    sys.stdout.write("\n".join(status_lines(status)) + "\n")
    return 0


def _status_error(msg: str, as_json: bool) -> int:
    if as_json:
        sys.stdout.write(json.dumps({"running": False, "error": msg}) + "\n")
    else:
        sys.stderr.write(f"error: {msg}\n")
    return 1


def rollout_cli(
    pool: str,
    engine: dict[str, Any],
    *,
    drain_deadline_s: float,
    warmup_budget_s: float,
    as_json: bool,
    console: Console,
) -> int:
    """Ask the running supervisor for a rolling upgrade and show its progress."""
    info = RunInfo.read(state_dir())
    if info is None:
        console.print(f"[red]error:[/red] {escape(no_supervisor())}")
        return 1
    body = {
        "pool": pool,
        "engine": engine,
        "drain_deadline_s": drain_deadline_s,
        "warmup_budget_s": warmup_budget_s,
    }

    async def go() -> dict[str, Any]:
        with console.status(f"rolling out pool {pool}") as st:

            def show(ev: dict[str, Any]) -> None:
                if as_json:
                    sys.stdout.write(json.dumps(ev) + "\n")
                if ev["event"] == "summary":
                    return
                text = _describe(ev)
                st.update(escape(text))
                console.print(f"  {text}", markup=False, highlight=False)

            try:
                return await SupervisorClient(info.control_socket).rollout(body, show)
            except SupervisorRejected as e:
                return {"ok": False, "error": str(e), "steps": []}

    try:
        summary = asyncio.run(go())
    except SupervisorError as e:
        console.print(f"[red]error:[/red] {escape(supervisor_error(e))}")
        return 1
    if not as_json and not summary.get("ok") and not summary.get("steps"):
        # Refused before any replica changed (no such pool, bad engine, another rollout).
        console.print(f"[red]error:[/red] {escape(str(summary.get('error')))}")
        return 1
    if not as_json:
        t = Table(title=f"rollout of {pool}: {'done' if summary.get('ok') else 'rolled back'}")
        for col in ("old", "new", "stage 1", "stage 2", "drain", "result"):
            t.add_column(col)
        for s in summary.get("steps", []):
            t.add_row(
                s["old"],
                s["new"] or "-",
                _secs(s["stage1_s"]),
                _secs(s["stage2_s"]),
                _secs(s["drain_s"]),
                "ok" if s["ok"] else (s["error"] or "-"),
            )
        console.print(t)
        if not summary.get("ok"):
            console.print(f"[red]rolled back:[/red] {escape(str(summary.get('error')))}")
    return 0 if summary.get("ok") else 1


def scale_cli(pool: str, replicas: int, *, console: Console) -> int:
    """Ask the running supervisor to resize an autoscaled pool (`POST /scale`, what the
    controller's autoscaler sends); answers when done."""
    info = RunInfo.read(state_dir())
    if info is None:
        console.print(f"[red]error:[/red] {escape(no_supervisor())}")
        return 1
    client = SupervisorClient(info.control_socket)
    try:
        with console.status(f"scaling {escape(pool)} to {replicas}"):
            res = asyncio.run(client.scale(pool, replicas, "unbroken scale (by hand)"))
    except SupervisorRejected as e:
        console.print(f"[red]error:[/red] {escape(e.message)}")
        return 1
    except SupervisorError as e:
        console.print(f"[red]error:[/red] {escape(supervisor_error(e))}")
        return 1
    line = f"pool {pool}: {res.get('from')} -> {res.get('replicas')} replica(s)"
    line += f" in {res.get('seconds')} s"
    for key in ("added", "removed"):
        if res.get(key):
            line += f"; {key} {', '.join(res[key])}"
    # The result on stdout, for `out=$(unbroken scale ...)`; warnings and errors on stderr.
    print(line, flush=True)
    if res.get("limited"):
        console.print(f"warning: {res['limited']}", markup=False)
    if not res.get("ok"):
        console.print(f"[red]error:[/red] {escape('; '.join(res.get('errors') or []))}")
        return 1
    if res.get("replicas") != replicas:
        console.print(
            f"[red]error:[/red] pool {escape(pool)} has {res.get('replicas')} replica(s), "
            f"not the {replicas} asked for"
        )
        return 1
    return 0


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def _describe(ev: dict[str, Any]) -> str:
    kind = ev["event"]
    if kind == "started":
        return f"replacing {ev['replicas']} replica(s) with {describe_engine(ev.get('engine'))}"
    if kind == "surge":
        return f"[{ev['index']}] started {ev['new']} (pid {ev['pid']}) beside {ev['old']}"
    if kind in ("stage1", "stage2"):
        what = "/health" if kind == "stage1" else "warm-up completion"
        return (
            f"{ev['new']}: {kind.replace('stage', 'stage ')} passed ({what}, {ev['seconds']:.2f} s)"
        )
    if kind == "ready":
        return f"{ev['new']} ready in the gateway"
    if kind == "prewarm":
        return (
            f"pre-warmed {ev['bytes'] / 1e9:.2f} GB of weights in {ev['seconds']:.2f} s "
            f"({ev['gbps']:.2f} GB/s)"
        )
    if kind == "draining":
        return f"draining {ev['old']} (deadline {ev['deadline_s']:g} s)"
    if kind == "replaced":
        return f"{ev['old']} stopped after {ev['drain_s']:.2f} s of drain (exit {ev['exit_code']})"
    if kind == "skipped":
        return f"skipped {ev['old']}: {ev['reason']}"
    if kind == "drain_failed":
        return f"could not drain {ev['old']} ({ev['reason']}); stopping it anyway"
    if kind == "stopped":
        return (
            f"stopped after {ev['seconds']:.1f} s: pool at {ev['live']} of "
            f"{ev['declared']} replica(s)"
        )
    if kind == "rollback":
        if not ev.get("new"):  # it failed before a new replica had a name
            return f"rolling back (no new replica had started): {ev['reason']}"
        return f"rolling back {ev['new']}: {ev['reason']}"
    if kind == "finished":
        return f"finished in {ev['seconds']:.1f} s"
    return json.dumps(ev)


def drain_cli(
    name: str, *, admin_url: str | None, deadline_s: float | None, timeout: float, console: Console
) -> int:
    """Mark an endpoint draining and wait until the gateway has let it go (preStop hook)."""
    import time

    from unbroken.clients import GatewayAdmin
    from unbroken.config.paths import read_admin_token

    info = RunInfo.read(state_dir())
    if info is not None and admin_url is None:
        done = _drain_supervised(name, info, deadline_s, timeout, console)
        if done is not None:
            return done
    url = admin_url or (info.admin_url if info else "http://127.0.0.1:8081")
    token = read_admin_token(state_dir(), info)
    if not token:
        where = (
            "" if info is not None else f"no pipeline runs in the state directory {state_dir()}; "
        )
        console.print(
            f"[red]error:[/red] {escape(where)}no admin token: set UNBROKEN_ADMIN_TOKEN, or "
            "give --admin-url with --token-file FILE",
            highlight=False,
        )
        return 2

    async def go() -> int:
        async with GatewayAdmin(url, token) as adm:
            try:
                ep = await adm.drain(name=name, deadline_s=deadline_s)
            except AdminError as e:
                console.print(f"[red]error:[/red] {escape(str(e))}")
                return 1
            console.print(f"draining {name}: {ep['inflight']} stream(s) in flight")
            t0 = time.monotonic()
            while time.monotonic() - t0 < timeout:
                eps = {e["name"]: e for e in await adm.endpoints()}
                if name not in eps:
                    console.print(f"{name} drained in {time.monotonic() - t0:.1f} s")
                    return 0
                await asyncio.sleep(0.2)
            console.print(f"[red]error:[/red] {escape(name)} still has streams after {timeout:g} s")
            return 1

    return asyncio.run(go())


def _drain_supervised(
    name: str, info: RunInfo, deadline_s: float | None, timeout: float, console: Console
) -> int | None:
    """Under `unbroken up`: the supervisor drains its replica, stops it and brings up a
    successor, so the pool keeps its size (docs/rollout.md). None when `name` is not one of
    its replicas (an endpoint added to the gateway by hand): the gateway drains it alone."""
    client = SupervisorClient(info.control_socket)
    try:
        with console.status(f"draining {escape(name)}"):
            res = asyncio.run(client.drain(name, deadline_s, timeout_s=timeout))
    except SupervisorRejected as e:
        if e.status == 404:
            return None
        console.print(f"[red]error:[/red] {escape(e.message)}")
        return 1
    except SupervisorError as e:
        if isinstance(e, SupervisorUnreachable) and e.refused:
            # A killed supervisor's data plane still serves: the gateway drains it alone.
            console.print(f"{no_supervisor()}; draining {name} in the gateway alone", markup=False)
            return None
        console.print(f"[red]error:[/red] {escape(supervisor_error(e))}")
        return 1
    if not res.get("ok"):
        console.print(f"[red]error:[/red] {escape(str(res.get('error')))}")
        return 1
    was = (
        f"{res['inflight']} stream(s) in flight at the start"
        if res.get("registered")
        else "the gateway no longer listed it"
    )
    console.print(
        f"{name} drained in {res['drain_s']:.1f} s ({was}); the supervisor stopped its engine",
        markup=False,
    )
    if res.get("replaced_by"):
        console.print(
            f"{res['replaced_by']} serves in its place (pool {res['pool']})", markup=False
        )
    else:
        console.print(
            f"warning: no successor yet ({res.get('replace_error')}); the supervisor keeps "
            "trying (see `unbroken status`)",
            markup=False,
        )
    return 0


def no_supervisor(state: Path | None = None) -> str:
    """What a command that needs the supervisor says when none runs in the state directory:
    a data plane a killed supervisor left serving is named (reload, rollout and scale need
    the supervisor; `unbroken up` adopts the data plane), else that no pipeline runs."""
    state = state or state_dir()
    orphan = _orphan(state)
    if orphan is not None:
        gw = orphan["gateway"]
        return (
            f"the supervisor is not running; the data plane still serves (gateway pid "
            f"{gw['pid']}, {gw.get('url')}); `unbroken up` with this state directory "
            f"({state}) adopts it"
        )
    return f"no pipeline is running in {state} (start one with `unbroken up`)"


def supervisor_error(e: SupervisorError) -> str:
    """What a command says when its call to the supervisor failed: `no_supervisor()` when
    nothing listens on the control socket (run.json outlives a SIGKILL), else the error."""
    return no_supervisor() if isinstance(e, SupervisorUnreachable) and e.refused else str(e)


def _orphan(state: Path) -> dict[str, Any] | None:
    """The data plane a supervisor that died left serving (its gateway still runs), or None."""
    plane = live_plane(state)
    if plane is None or not (plane.get("gateway") or {}).get("alive"):
        return None
    return plane


# `unbroken down` waits this much beyond the stop budget the supervisor announces.
DOWN_MARGIN_S = 10.0


def _stop_budget(info: RunInfo) -> float | None:
    """How long the running supervisor's stop may take (its status says), or None."""

    async def ask() -> dict[str, Any]:
        return await asyncio.wait_for(SupervisorClient(info.control_socket).status(), 5)

    try:
        budget = asyncio.run(ask()).get("stop_budget_s")
    except (SupervisorError, TimeoutError, OSError):
        return None
    return float(budget) if isinstance(budget, int | float) else None


def down_cli(timeout: float = 60.0) -> int:
    """Stop the pipeline of the state directory: SIGTERM its supervisor and wait (it stops
    the gateway first, which drains its streams, then the engines within their shutdown
    timeout), as long as the supervisor says its stop may take (else `timeout`); with no
    supervisor, stop the data plane it left."""
    import time

    state = state_dir()
    info = RunInfo.read(state)
    if info is not None:
        budget = _stop_budget(info)
        os.kill(info.pid, signal.SIGTERM)
        wait = timeout if budget is None else budget + DOWN_MARGIN_S
        sys.stdout.write(
            f"stopping the pipeline (supervisor pid {info.pid}): the gateway drains its "
            "streams, then the engines finish theirs"
            + (f"; up to {budget:.0f} s" if budget is not None else "")
            + "\n"
        )
        sys.stdout.flush()
        deadline = time.monotonic() + wait
        while RunInfo.read(state) is not None:
            if time.monotonic() > deadline:
                sys.stderr.write(
                    f"error: the supervisor (pid {info.pid}) still runs after {wait:.0f} s\n"
                )
                return 1
            time.sleep(0.1)
        sys.stdout.write(f"stopped the pipeline (supervisor pid {info.pid})\n")
        return 0
    pids = asyncio.run(stop_plane(state))
    (state / "run.json").unlink(missing_ok=True)
    # What the dead supervisor would have cleaned at its stop: Prometheus's targets (else it
    # scrapes the stopped processes' ports, or whatever takes them next) and its socket.
    if (state / "prometheus").is_dir():
        with contextlib.suppress(OSError):
            write_targets(state / "prometheus", {j: [] for j in JOBS})
    (state / "supervisor.sock").unlink(missing_ok=True)
    if not pids:
        sys.stdout.write("no pipeline is running\n")
        return 0
    sys.stdout.write(
        f"stopped the data plane left without a supervisor: pid(s) {', '.join(map(str, pids))}\n"
    )
    return 0


def reload_cli() -> int:
    """Ask the running supervisor to re-read its spec and reload the gateway; print what
    changed and what only a restart applies. 1 when refused (nothing changed)."""
    info = RunInfo.read(state_dir())
    if info is None:
        sys.stderr.write(f"error: {no_supervisor()}\n")
        return 2
    try:
        res = asyncio.run(SupervisorClient(info.control_socket).reload())
    except SupervisorRejected as e:
        sys.stderr.write(f"error: reload refused, nothing changed: {e.message}\n")
        return 1
    except SupervisorError as e:
        sys.stderr.write(f"error: {supervisor_error(e)}\n")
        return 2 if isinstance(e, SupervisorUnreachable) and e.refused else 1
    sys.stdout.write("\n".join(reload_lines(res)) + "\n")
    return 0


def reload_lines(res: dict[str, Any]) -> list[str]:
    src = res.get("spec") or "the default spec"
    out = [
        f"gateway (pid {res['gateway_pid']}) reloaded from {src}: generation "
        f"{res['generation']} serving; old workers finish their streams",
    ]
    if res["changed"]:
        out.append("changed:")
        out += [f"  {_change_line(c)}" for c in res["changed"]]
    else:
        out.append("gateway settings: no change")
    if res["not_applied"]:
        out.append("not applied; restart `unbroken up` to apply:")
        out += [f"  {_change_line(c)}" for c in res["not_applied"]]
        if any(".engine." in c["key"] for c in res["not_applied"]):
            # A rollout changes the running pool, not the file (a review read this list as
            # the rollout waiting to be applied).
            out.append(
                "  (a pool's engine that differs from the file is often a rollout made since "
                "the start: it is not written back to the spec, and a restart would go back to "
                "the file's engine)"
            )
    out += [f"warning: {w}" for w in res.get("warnings", [])]
    return out


def _change_line(c: dict[str, Any]) -> str:
    def show(v: Any) -> str:
        return v if isinstance(v, str) else json.dumps(v)

    return f"{c['key']}: {show(c['old'])} -> {show(c['new'])}"
