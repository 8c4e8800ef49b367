"""`unbroken fault`: inject a fault (or a contention episode) into engines of the running
pipeline. Finds the pipeline (its state directory or a gateway admin URL), resolves the admin
and engine tokens, lists the endpoints through the gateway and calls each chosen engine's
admin API at once. Errors are printed as `error: ...` lines with the exit code the command
returns: 2 for a bad request or option, 1 for an unreachable gateway or engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["FAULT_PARAMS", "run_fault"]

# Each kind and the parameters it takes (the engine's admin API names).
FAULT_PARAMS: dict[str, set[str]] = {
    "slow_cuda": {"duration_s", "extra_ms", "factor", "jitter_ms", "onset_s", "ramp_s"},
    "hang": {"duration_s"},
    "fail": {"duration_s", "fraction", "after_tokens"},
    "crash": set(),
    "clear": set(),
    "show": set(),
}
# The command's option for a parameter whose name differs.
_FLAG = {"duration_s": "seconds", "onset_s": "onset", "ramp_s": "ramp"}


class _Refused(Exception):
    """An option or a lookup that ends the command before any engine is called."""


def _error(console: Console, message: str) -> None:
    from rich.markup import escape

    console.print(f"[red]error:[/red] {escape(message)}")


def _plan(
    target: str,
    kind: str | None,
    every: bool,
    given: Mapping[str, float | int | None],
    admin_url: str | None,
) -> tuple[str, str, dict[str, Any]]:
    """(endpoint name, kind, parameters) from the arguments, checked in the order the command
    reports them; with `every` the first argument is the kind and there is no name."""
    if every:
        if kind is not None:
            raise _Refused("with --all give only KIND (no endpoint name)")
        kind, target = target, ""
    if kind is None:
        raise _Refused(f"give a fault KIND after the endpoint: {', '.join(FAULT_PARAMS)}")
    if kind not in FAULT_PARAMS:
        raise _Refused(f"unknown fault kind {kind!r}: expected {', '.join(FAULT_PARAMS)}")
    if admin_url is not None and not admin_url.startswith(("http://", "https://")):
        raise _Refused(f"--admin-url {admin_url!r}: expected http(s)://HOST:PORT")
    params = {k: v for k, v in given.items() if v is not None}
    if bad := sorted(set(params) - FAULT_PARAMS[kind]):
        names = ", ".join("--" + _FLAG.get(b, b).replace("_", "-") for b in bad)
        raise _Refused(f"{names}: not an option of {kind}")
    return target, kind, params


def _tokens(admin_url: str | None) -> tuple[str, str, str | None]:
    """(gateway admin URL, admin token, engine token): from the environment, else the
    running pipeline's state directory."""
    from unbroken.config.paths import (
        RunInfo,
        engine_token_path,
        read_admin_token,
        read_engine_token,
        state_dir,
    )

    state = state_dir()
    info = RunInfo.read(state)
    if admin_url is None and info is None:
        raise _Refused(
            f"no pipeline running (UNBROKEN_STATE_DIR={state}): start one with `unbroken up`"
        )
    url = admin_url or (info.admin_url if info else "")
    token = read_admin_token(state, info)
    if not token:
        raise _Refused("no admin token: set UNBROKEN_ADMIN_TOKEN")
    # The engines' own token (`unbroken up` writes one); the admin token where there is none.
    try:
        engine_token = read_engine_token(state)
    except OSError as e:
        raise _Refused(f"{engine_token_path(state)}: {e.strerror}") from None
    return url, token, engine_token


async def _fan_out(
    console: Console,
    url: str,
    token: str,
    engine_token: str | None,
    target: str,
    kind: str,
    params: dict[str, Any],
    every: bool,
    as_json: bool,
) -> int:
    """List the endpoints through the gateway, then call every chosen engine at once."""
    from unbroken.clients import AdminError, AdminRejected, EngineAdmin, GatewayAdmin

    async def one(name: str, engine_url: str) -> tuple[str, object]:
        async with EngineAdmin(engine_url, engine_token or token) as eng:
            if kind == "clear":
                return name, await eng.clear()
            if kind == "show":
                return name, await eng.faults()
            return name, await eng.inject(kind=kind, **params)

    try:
        async with GatewayAdmin(url, token) as gw:
            eps = await gw.endpoints()
    except AdminError as e:
        _error(console, f"cannot list endpoints at {url}: {e}")
        return 1
    chosen = eps if every else [e for e in eps if e["name"] == target]
    if not chosen:
        names = ", ".join(sorted(e["name"] for e in eps)) or "none"
        _error(console, f"no endpoint named {target!r} (known: {names})")
        return 2
    results = await asyncio.gather(
        *(one(e["name"], e["url"]) for e in chosen), return_exceptions=True
    )
    rc, out = 0, {}
    for e, res in zip(chosen, results, strict=True):
        if isinstance(res, AdminError):
            code = 2 if isinstance(res, AdminRejected) and res.status == 400 else 1
            rc = max(rc, code)
            _error(console, e["name"] + ": " + str(res))
            continue
        if isinstance(res, BaseException):
            raise res
        out[res[0]] = res[1]
        if not as_json:
            print(f"{res[0]}: {json.dumps(res[1])}")
    if as_json:
        print(json.dumps(out, indent=1))
    return rc


def run_fault(
    target: str,
    kind: str | None,
    *,
    every: bool = False,
    params: Mapping[str, float | int | None],
    admin_url: str | None = None,
    as_json: bool = False,
    console: Console,
) -> int:
    """Inject `kind` with `params` (None: not given) into the endpoint `target`, or into every
    engine of the pipeline with `every`; print each engine's answer. Returns the exit code."""
    try:
        target, kind, given = _plan(target, kind, every, params, admin_url)
        url, token, engine_token = _tokens(admin_url)
    except _Refused as e:
        _error(console, str(e))
        return 2
    return asyncio.run(
        _fan_out(console, url, token, engine_token, target, kind, given, every, as_json)
    )
