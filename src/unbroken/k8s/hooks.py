"""Pod hooks for engine containers: the two-stage readiness check and the preStop drain.

Standard library only, on purpose: the engine container runs the vLLM image, which has a
`python3` but not our dependencies. An initContainer of the unbroken image copies this one
file into a shared `emptyDir` (`python -m unbroken.k8s.hooks install DIR`), and the engine
container's probe and preStop run `python3 DIR/hooks.py ready|drain ...`. The same functions
back `unbroken ready` and `unbroken drain --every-address`.

Exit status: 0 ready / drained, 1 not ready / not drained in time, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "drain_everywhere",
    "endpoint_name",
    "gateway_addresses",
    "install",
    "main",
    "pod_endpoint_name",
    "ready",
]


def _request(
    url: str,
    *,
    method: str = "GET",
    body: Any = None,
    token: str | None = None,
    timeout: float = 5.0,
) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def ready(
    url: str, *, budget_ms: float, model: str | None = None, api_key: str | None = None
) -> tuple[bool, str]:
    """Stage 1: `/health` answers 200. Stage 2: a one-token greedy completion succeeds within
    `budget_ms` (a cold engine, still compiling or paging weights in, misses it). `api_key`:
    the engine's own (vLLM's --api-key guards /v1, not /health)."""
    url = url.rstrip("/")
    try:
        status, _ = _request(url + "/health", timeout=2.0)
        if status != 200:
            return False, f"stage 1: /health answered {status}"
        if model is None:
            status, body = _request(url + "/v1/models", token=api_key, timeout=5.0)
            if status != 200:
                return False, f"stage 2: /v1/models answered {status}"
            models = sorted(m["id"] for m in json.loads(body).get("data", []))
            if not models:
                return False, "stage 2: /v1/models lists no model"
            model = models[0]
        t0 = time.monotonic()
        status, _ = _request(
            url + "/v1/completions",
            method="POST",
            body={"model": model, "prompt": "warm up", "max_tokens": 1, "temperature": 0},
            token=api_key,
            timeout=budget_ms / 1e3,
        )
        took = (time.monotonic() - t0) * 1e3
    except (OSError, ValueError, KeyError, TypeError) as e:
        return False, f"{type(e).__name__}: {e}"
    if status != 200:
        return False, f"stage 2: warm-up completion answered {status}"
    if took > budget_ms:
        return False, f"stage 2: warm-up took {took:.0f} ms > budget {budget_ms:.0f} ms"
    return True, f"ready (warm-up {took:.0f} ms)"


def gateway_addresses(admin: str, *, every_address: bool) -> list[str]:
    """Base URLs of the gateway admin APIs to drain on. With `every_address` the host is
    resolved to all its addresses: a headless Service's name gives one per gateway pod, and
    each replica has its own endpoint table, so each must drain."""
    admin = admin if "://" in admin else f"http://{admin}"
    parts = urllib.parse.urlsplit(admin)
    if not every_address or parts.hostname is None:
        return [admin.rstrip("/")]
    port = parts.port or (443 if parts.scheme == "https" else 80)
    infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    # One family: a dual-stack name lists each pod twice, and the gateway may listen on
    # 0.0.0.0 only. IPv4 when there is any, else IPv6.
    v4 = [i for i in infos if i[0] == socket.AF_INET]
    hosts = sorted({str(i[4][0]) for i in (v4 or infos)})
    return [
        f"{parts.scheme}://{f'[{h}]' if ':' in h else h}:{port}{parts.path}".rstrip("/")
        for h in hosts
    ]


def drain_everywhere(
    name: str,
    bases: list[str],
    *,
    token: str,
    deadline_s: float | None,
    timeout: float,
    log: Callable[[str], None] = print,
) -> bool:
    """Drain endpoint `name` on every gateway and wait until each has let it go.

    An endpoint already draining (the EndpointSlice's `terminating` got there first) is not
    drained again, so its deadline is not pushed back. A gateway that does not know the
    endpoint (404) has nothing to drain. An unreachable gateway is retried until `timeout`:
    it cannot be sending this pod traffic while unreachable, but may still hold streams."""
    quoted = urllib.parse.quote(name, safe="")
    pending = set(bases)
    asked: set[str] = set()
    t0 = time.monotonic()
    while pending and time.monotonic() - t0 < timeout:
        for base in sorted(pending):
            ep_url = f"{base}/admin/endpoints/{quoted}"
            try:
                status, body = _request(ep_url, token=token, timeout=3.0)
                if status == 404:
                    pending.discard(base)
                    log(f"{base}: {name} drained" if base in asked else f"{base}: {name} unknown")
                    continue
                if status != 200:
                    log(f"{base}: GET {name} answered {status}: {body[:200]!r}")
                    continue
                state = json.loads(body).get("state")
                if base not in asked and state != "draining":
                    drain = {} if deadline_s is None else {"deadline_s": deadline_s}
                    status, body = _request(
                        ep_url + "/drain", method="POST", body=drain, token=token, timeout=3.0
                    )
                    if status >= 300 and status != 404:
                        log(f"{base}: drain {name} answered {status}: {body[:200]!r}")
                        continue
                    log(f"{base}: draining {name}")
                asked.add(base)
            except (OSError, ValueError) as e:
                log(f"{base}: {type(e).__name__}: {e}")
        if pending:
            time.sleep(0.25)
    if pending:
        log(f"{name} still held by {', '.join(sorted(pending))} after {timeout:g} s")
        return False
    log(f"{name} drained on {len(bases)} gateway(s) in {time.monotonic() - t0:.1f} s")
    return True


def install(directory: Path) -> Path:
    """Copy this file where the engine container can run it with a plain `python3`."""
    directory.mkdir(parents=True, exist_ok=True)
    dest = directory / "hooks.py"
    shutil.copyfile(__file__, dest)
    return dest


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        return Path(args.token_file).read_text().strip()
    return os.environ.get("UNBROKEN_ADMIN_TOKEN") or None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hooks.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("ready", help="two-stage readiness check of an engine")
    r.add_argument("--url", default="http://127.0.0.1:8000")
    r.add_argument("--budget-ms", type=float, default=5000.0)
    r.add_argument("--model", default=None)
    r.add_argument("--api-key-env", default=None, help="variable holding the engine's API key")
    d = sub.add_parser("drain", help="drain this pod's endpoint on every gateway, then wait")
    d.add_argument("name", nargs="?", default=None, help="endpoint name [POD_NAME.POD_NAMESPACE]")
    d.add_argument("--admin", required=True, help="gateway admin host:port or URL")
    d.add_argument("--every-address", action="store_true")
    d.add_argument("--token-file", default=None)
    d.add_argument("--deadline", type=float, default=None)
    d.add_argument("--timeout", type=float, default=600.0)
    i = sub.add_parser("install", help="copy this file into DIR")
    i.add_argument("directory", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "ready":
        key = os.environ.get(args.api_key_env) if args.api_key_env else None
        ok, why = ready(args.url, budget_ms=args.budget_ms, model=args.model, api_key=key)
        print(why, file=sys.stderr)
        return 0 if ok else 1
    if args.cmd == "install":
        print(install(args.directory))
        return 0
    name = args.name or pod_endpoint_name()
    token = _token(args)
    if not name or not token:
        print("need an endpoint name (or POD_NAME) and a token", file=sys.stderr)
        return 2
    try:
        bases = gateway_addresses(args.admin, every_address=args.every_address)
    except OSError as e:
        print(f"cannot resolve {args.admin}: {e}", file=sys.stderr)
        return 1
    ok = drain_everywhere(
        name,
        bases,
        token=token,
        deadline_s=args.deadline,
        timeout=args.timeout,
        log=lambda m: print(m, file=sys.stderr),
    )
    return 0 if ok else 1


def endpoint_name(pod: str, namespace: str | None) -> str:
    """The gateway's name for a pod's endpoint; discovery and the preStop hook both use it."""
    return f"{pod}.{namespace}" if namespace else pod


def pod_endpoint_name() -> str | None:
    pod = os.environ.get("POD_NAME")
    return endpoint_name(pod, os.environ.get("POD_NAMESPACE")) if pod else None


if __name__ == "__main__":
    sys.exit(main())
