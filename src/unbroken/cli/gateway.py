"""`unbroken gateway`: options to `gateway.config.prepare` (settings, endpoints,
discovery), then `run_gateway`."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Annotated

import typer

from unbroken.cli.common import app, bind_error, fail, setup_logging


@app.command(context_settings={"allow_extra_args": True})
def gateway(
    ctx: typer.Context,
    endpoint: Annotated[
        list[str] | None,
        typer.Option(
            "--endpoint",
            "-e",
            "--worker-urls",
            help="Engine URL, optionally POOL=URL. Repeat for more (vllm-router's "
            "--worker-urls A B ...: the same).",
        ),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="Gateway settings (JSON or YAML); flags override it.")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address for the OpenAI routes.")] = None,
    port: Annotated[int | None, typer.Option(help="Port for the OpenAI routes [8080].")] = None,
    admin_host: Annotated[str | None, typer.Option(help="Address for the admin API.")] = None,
    admin_port: Annotated[int | None, typer.Option(help="Port for the admin API [8081].")] = None,
    admin_token: Annotated[
        str | None,
        typer.Option(envvar="UNBROKEN_ADMIN_TOKEN", help="Bearer token for the admin API."),
    ] = None,
    priority_header: Annotated[
        str | None, typer.Option(help="Header carrying the priority [x-unbroken-priority].")
    ] = None,
    cap: Annotated[
        int | None, typer.Option(help="Default in-flight cap per endpoint [256].")
    ] = None,
    queue_timeout: Annotated[
        float | None, typer.Option(help="Seconds a request may wait for a slot [30].")
    ] = None,
    request_timeout: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Seconds a non-streamed request may take across its attempts (then 504 "
            "upstream_timeout), and the longest an old worker keeps its streams after a "
            "reload [600].",
        ),
    ] = None,
    no_warmup: Annotated[
        bool, typer.Option("--no-warmup", help="Skip the warm-up completion (stage 2).")
    ] = False,
    k8s_service: Annotated[
        list[str] | None,
        typer.Option(
            help="Discover a pool from a Service's EndpointSlices: POOL=NAMESPACE/SERVICE[:PORT]."
        ),
    ] = None,
    k8s_peers: Annotated[
        str | None,
        typer.Option(help="This gateway's own Service (NAMESPACE/SERVICE): replicas share caps."),
    ] = None,
    pool_cap: Annotated[
        list[str] | None,
        typer.Option(help="In-flight cap per engine of a pool, all replicas together: POOL=N."),
    ] = None,
    pod_name: Annotated[
        str | None, typer.Option(envvar="POD_NAME", help="This pod's name (with --k8s-peers).")
    ] = None,
    pod_namespace: Annotated[
        str | None, typer.Option(envvar="POD_NAMESPACE", help="This pod's namespace.")
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="Serving processes on the one port [one per core, at most 8]. 1: a single "
            "process (no reload). More: a main process (admin API, probes) and N workers; "
            "SIGHUP reloads them without refusing a connection.",
        ),
    ] = None,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            help="On SIGTERM, seconds open streams may take to finish before they are ended "
            "with an SSE error event (a second SIGTERM ends them at once).",
        ),
    ] = 30.0,
    routing: Annotated[
        str | None,
        typer.Option(
            "--routing",
            "--policy",
            "--routing-logic",
            help="Routing policy: prefix (cache- and session-aware) [default], session, "
            "latency, least_load, power_of_two, round_robin, random (vllm-router's "
            "--policy cache_aware and consistent_hash: prefix and session; production-stack's "
            "--routing-logic prefixaware, session and roundrobin too).",
        ),
    ] = None,
    session_header: Annotated[
        str | None,
        typer.Option(
            "--session-header",
            "--session-key",
            help="Header naming a conversation for session affinity [x-session-id] "
            "(production-stack's --session-key); else the body's prompt_cache_key or user.",
        ),
    ] = None,
    upstream_key_env: Annotated[
        list[str] | None,
        typer.Option(
            help="[POOL=]VAR: the engines' API key (vLLM --api-key) is in environment "
            "variable VAR, sent as their Bearer token (the client's own Authorization is "
            "never forwarded); without POOL, for every pool without its own. Repeatable.",
        ),
    ] = None,
    max_body_bytes: Annotated[
        int | None,
        typer.Option(
            min=1024,
            help="Largest request body accepted (413 above it) [8 MiB]. vLLM sets none: raise "
            "it for large multimodal (base64) requests.",
        ),
    ] = None,
    accept_pack_cpu: Annotated[
        float | None,
        typer.Option(
            min=0,
            max=8,
            help="With several workers: one worker takes every new connection while its CPU "
            "is under this share of a core, then they spread [0.5]. 0: always spread.",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Run the streaming gateway in front of OpenAI-compatible engines (vLLM included)."""
    from unbroken.gateway import default_workers, run_gateway
    from unbroken.gateway.config import prepare

    setup_logging(verbose)
    endpoint = [*(endpoint or []), *_worker_urls(ctx.args, endpoint)]
    flags = {
        "host": host,
        "port": port,
        "admin_host": admin_host,
        "admin_port": admin_port,
        "priority_header": priority_header,
        "default_cap": cap,
        "queue_timeout_s": queue_timeout,
        "request_timeout_s": request_timeout,
        "routing": routing,
        "session_header": session_header,
        "upstream_key_env": None if not upstream_key_env else _key_envs(upstream_key_env),
        "max_body_bytes": max_body_bytes,
        "accept_pack_cpu": accept_pack_cpu,
    }
    try:
        launch = prepare(
            endpoint or [],
            config,
            flags,
            k8s_service=k8s_service or [],
            k8s_peers=k8s_peers,
            pool_cap=pool_cap or [],
            pod_name=pod_name,
            pod_namespace=pod_namespace,
        )
    except ValueError as e:
        fail(str(e))
    log = logging.getLogger("unbroken.gateway")
    asked = routing if routing and routing != launch.cfg.routing else None
    log.info("routing: %s%s", launch.cfg.routing, f" (asked as {asked!r})" if asked else "")
    for pool, var in sorted(launch.cfg.upstream_key_env.items()):
        if var not in os.environ:
            # Not fatal (an engine may need no key), but a typo would show only as 401s later.
            log.warning(
                "upstream_key_env: %s is not set in the environment: %s engines get no API "
                "key (vLLM started with --api-key answers 401)",
                var,
                "every pool's" if pool == "*" else f"pool {pool}'s",
            )
    try:
        run_gateway(
            launch.cfg,
            admin_token,
            launch.static,
            warmup=not no_warmup,
            k8s=launch.k8s,
            workers=workers or default_workers(),
            shutdown_timeout=shutdown_timeout,
            reload_cfg=launch.load,
        )
    except OSError as e:
        option = (
            "--port / --admin-port (under `unbroken up`: its --port / --admin-port, or the "
            "spec's gateway.port / gateway.admin_port)"
        )
        if (msg := bind_error(e, option)) is None:
            raise
        fail(msg)


def _key_envs(items: list[str]) -> dict[str, str]:
    """`--upstream-key-env [POOL=]VAR` as `upstream_key_env` (`*`: every other pool)."""
    out: dict[str, str] = {}
    for item in items:
        pool, sep, var = item.rpartition("=")
        pool = pool if sep else "*"
        if not var or not pool or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", var):
            fail(f"--upstream-key-env {item!r}: expected [POOL=]VAR, VAR an environment variable")
        out[pool] = var
    return out


def _worker_urls(extra: list[str], given: list[str] | None) -> list[str]:
    """Arguments left after the options: the rest of vllm-router's `--worker-urls A B C`
    (one option, several values), taken as more endpoints when they look like engine URLs
    and at least one was given; anything else is refused as click would."""
    if not extra:
        return []
    urls = [a for a in extra if re.match(r"^([A-Za-z0-9_.-]+=)?https?://", a)]
    if not given or len(urls) != len(extra):
        stray = [a for a in extra if a not in urls] or extra
        fail(
            f"unexpected argument(s): {' '.join(stray)} (engines are given as "
            "--endpoint URL, repeated, or --worker-urls URL URL ...)"
        )
    return urls
