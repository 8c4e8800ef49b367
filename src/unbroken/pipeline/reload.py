"""`unbroken reload` (POST /reload on the control socket): the spec read again and applied to
a running gateway without a restart.

The gateway's settings are rendered again (`render_gateway_settings`, the same as at start)
into gateway.json, the gateway is sent SIGHUP and the reload waits until its new generation
of workers serves; routes and pool caps go through the admin API (the gateway's main process
keeps them otherwise). An autoscaled pool's `scaling` settings are applied with its cap, in
one step (the controller reads both from the supervisor's `GET /pools`): a lowered cap with
a lowered `scaling.target` was applied without the target, leaving the pool in the state
the spec check refuses (a target above the cap: the pool never scaled out). What only a
restart can change (where the gateway listens, the prober's settings, the model, pools'
ranges and engines, the controller and agent) is listed with the spec diff
(`not_applied`), never applied. A refused or failed reload changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken.clients import AdminError
from unbroken.config.spec import GatewaySettings, PipelineSpec, SpecError
from unbroken.pipeline.gateway_proc import render_gateway_settings
from unbroken.pipeline.procs import Proc

if TYPE_CHECKING:
    from unbroken.pipeline.supervisor import Supervisor

__all__ = [
    "GATEWAY_RESTART_KEYS",
    "RELOAD_TIMEOUT_S",
    "ReloadError",
    "Reloader",
    "diff",
    "flatten",
    "not_applied",
]

log = logging.getLogger("unbroken.pipeline")


class ReloadError(RuntimeError):
    """A reload refused or failed; nothing changed. `status` is the control API's answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# Gateway settings a running gateway keeps until it is restarted: where it listens (the main
# process owns the listening socket and the admin API) and the prober's, which the main
# process reads only at start. A reload reports a change of these as not applied.
GATEWAY_RESTART_KEYS = (
    "host",
    "port",
    "admin_host",
    "admin_port",
    "probe_interval_s",
    "health_fail_threshold",
    "warmup_timeout_s",
)
RELOAD_TIMEOUT_S = 60.0  # the gateway allows each new worker 30 s to serve

_MISSING = "(absent)"


# -- the spec diff ------------------------------------------------------------------------------
def flatten(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Nested settings as dotted keys (`gateway.routes.critical`), for a line-per-key diff."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "priority_keys":  # its keys are API keys
            out.update(flatten(v, f"{prefix}{k}."))
        elif k == "tenants" and isinstance(v, list):
            # One line per field of each tenant, by name (`gateway.tenants.acme.limits.
            # concurrent_streams: 3 -> null`), not the whole list twice with its digests.
            for t in v:
                t = dict(t)
                name = t.pop("name", "?")
                out.update(flatten(t, f"{prefix}tenants.{name}."))
        else:
            out[prefix + k] = v
    return out


def _hidden(v: Any) -> Any:
    if v == _MISSING:
        return v
    if isinstance(v, dict | list):  # a count says what changed without saying the keys
        return f"{len(v)} key(s), hidden" if v else "none"
    return "none" if v is None or v == "" else "(hidden)"


def change(key: str, old: Any, new: Any) -> dict[str, Any]:
    """One line of a reload's report; never a secret: API keys (`priority_keys`' keys are
    API keys too) and engine environment values are hidden."""
    parts = key.split(".")
    if parts[-1] in ("api_key", "priority_keys", "api_keys") or (
        len(parts) > 1 and parts[-2] == "env"
    ):
        old, new = _hidden(old), _hidden(new)
    return {"key": key, "old": old, "new": new}


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        change(k, old.get(k, _MISSING), new.get(k, _MISSING))
        for k in sorted(old.keys() | new.keys())
        if old.get(k, _MISSING) != new.get(k, _MISSING)
    ]


def not_applied(running: PipelineSpec, new: PipelineSpec) -> list[dict[str, Any]]:
    """What differs between the running pipeline and the spec read again, outside what a
    reload applies (gateway settings but GATEWAY_RESTART_KEYS, pool caps)."""
    a, b = running.model_dump(mode="json"), new.model_dump(mode="json")
    out = [change("model", a["model"], b["model"])] if a["model"] != b["model"] else []
    out += diff(
        {f"gateway.{k}": a["gateway"][k] for k in GATEWAY_RESTART_KEYS},
        {f"gateway.{k}": b["gateway"][k] for k in GATEWAY_RESTART_KEYS},
    )
    pa = {p["name"]: p for p in a["pools"]}
    pb = {p["name"]: p for p in b["pools"]}
    for name in sorted(pa.keys() | pb.keys(), key=lambda n: (n not in pa, n)):
        if name not in pb:
            out.append({"key": f"pools.{name}", "old": "(running)", "new": "(removed)"})
        elif name not in pa:
            out.append({"key": f"pools.{name}", "old": _MISSING, "new": "(new pool)"})
        else:
            pa[name].pop("cap"), pb[name].pop("cap")  # applied
            if pa[name].get("autoscale") and pb[name].get("autoscale"):
                # The autoscaler's count, not the spec's starting one: not a change.
                pa[name].pop("replicas"), pb[name].pop("replicas")
                pa[name].pop("scaling"), pb[name].pop("scaling")  # applied, with the cap
            out += diff(flatten(pa[name], f"pools.{name}."), flatten(pb[name], f"pools.{name}."))
    if list(pa) != list(pb) and pa.keys() == pb.keys():  # the default routes' order
        out.append(change("pools (order)", list(pa), list(pb)))
    for section in ("controller", "agent"):
        out += diff(flatten(a[section], f"{section}."), flatten(b[section], f"{section}."))
    return out


def _reload_failure(path: Path, offset: int) -> str | None:
    """The gateway's own words when it abandoned a reload (logged after `offset`)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if any(m in line for m in ("reload failed", "reload: cannot read", "already under way")):
            return line.split(": ", 1)[-1]  # the message, without time, level and logger
    return None


# -- the reload ---------------------------------------------------------------------------------
@dataclass
class _Plan:
    """A reload worked out before anything is touched."""

    gateway: GatewaySettings  # the spec's section as applied (restart-only keys as running)
    old: GatewaySettings
    new: GatewaySettings
    changed: list[dict[str, Any]]
    # Per pool, what a reload applies to it (`cap`, an autoscaled pool's `scaling`), in one
    # update of the supervisor's pool spec.
    pools: dict[str, dict[str, Any]]
    not_applied: list[dict[str, Any]]
    spec: PipelineSpec  # the file read again


class Reloader:
    """One reload at a time, and never beside a rollout, conversion or scaling (they share
    the supervisor's `change_lock`: pool caps must not race a rollout's set_pool)."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.running = False

    async def reload(self) -> dict[str, Any]:
        """Read the spec again and apply it; the report (`changed`, `not_applied`,
        `generation`, `warnings`). ReloadError (nothing changed) on a spec that does not
        validate, or when the gateway's new workers do not come up."""
        if self.running:
            raise ReloadError(409, "a reload is already under way")
        if self.sup.change_lock.locked():
            raise ReloadError(409, "a rollout or conversion is running; reload once it is done")
        self.running = True
        try:
            async with self.sup.change_lock:
                return await self._reload()
        finally:
            self.running = False

    def _source(self) -> str:
        return str(self.sup.spec_path) if self.sup.spec_path else "the default spec"

    def _read(self) -> PipelineSpec:
        """The spec read again (ReloadError 400 if it does not parse, validate, or routes to
        a pool this pipeline does not run)."""
        sup, source = self.sup, self._source()
        try:
            new = sup.reload_spec() if sup.reload_spec else sup.spec.model_copy(deep=True)
        except SpecError as e:
            raise ReloadError(400, str(e)) from None
        except Exception as e:  # e.g. a file that is not UTF-8
            raise ReloadError(400, f"{source}: {type(e).__name__}: {e}") from None
        running = {p.name for p in sup.spec.pools}
        for prio, pools in new.gateway.routes.items():
            if unknown := [p for p in pools if p not in running]:
                raise ReloadError(
                    400,
                    f"{source}: gateway.routes.{prio} names pool(s) this pipeline does not run: "
                    f"{', '.join(unknown)} (a new pool needs a restart of `unbroken up`)",
                )
        return new

    def _plan(self, new: PipelineSpec) -> _Plan:
        spec = self.sup.spec
        # What a running gateway cannot change stays as it is, in gateway.json too: a gateway
        # restarted after a crash must come back on the same ports.
        applied = new.gateway.model_copy(
            update={k: getattr(spec.gateway, k) for k in GATEWAY_RESTART_KEYS}
        )
        old_r = render_gateway_settings(spec)
        # The spec-wide parts the gateway enforces (tenants, the rate-limit store) are its
        # settings too: the new file's (they were the running spec's, so a reload said "no
        # change" and a removed tenant's key kept working).
        new_r = render_gateway_settings(self._applied_spec(new, applied))
        changed = diff(
            flatten(old_r.model_dump(mode="json"), "gateway."),
            flatten(new_r.model_dump(mode="json"), "gateway."),
        )
        # A pool's cap is the gateway's in-flight cap per replica: applied too; and an
        # autoscaled pool's scaling settings, which the new file checked against its cap.
        pools: dict[str, dict[str, Any]] = {}
        for p in spec.pools:
            q = next((q for q in new.pools if q.name == p.name), None)
            if q is None:
                continue
            if q.cap != p.cap:
                pools.setdefault(p.name, {})["cap"] = q.cap
                changed.append(change(f"pools.{p.name}.cap", p.cap, q.cap))
            if p.autoscale and q.autoscale and q.scaling != p.scaling:
                pools.setdefault(p.name, {})["scaling"] = q.scaling
                changed += diff(
                    flatten(p.scaling.model_dump(mode="json"), f"pools.{p.name}.scaling."),
                    flatten(q.scaling.model_dump(mode="json"), f"pools.{p.name}.scaling."),
                )
        return _Plan(applied, old_r, new_r, changed, pools, not_applied(spec, new), new)

    def _applied_spec(self, new: PipelineSpec, gateway: GatewaySettings) -> PipelineSpec:
        """The running spec with what a reload applies taken from `new`: the gateway section
        and the spec-wide parts the gateway enforces (tenants, the rate-limit store)."""
        applied = self.sup.spec.model_copy(
            update={"gateway": gateway, "tenants": new.tenants, "rate_limit": new.rate_limit}
        )
        if "rate_limit" not in new.model_fields_set:
            # Not in the file: the gateway section's store, as `gateway_settings` renders it.
            applied.model_fields_set.discard("rate_limit")
        return applied

    async def _reload(self) -> dict[str, Any]:
        sup = self.sup
        plan = self._plan(self._read())
        proc = sup.gateway.proc
        if proc is None or proc.returncode is not None:
            raise ReloadError(503, "the gateway is not running (being restarted); try again")
        try:
            before = (await sup.admin.status()).get("workers", {}).get("generation")
        except AdminError as e:
            raise ReloadError(503, f"the gateway's admin API does not answer: {e}") from None
        if before is None:
            raise ReloadError(500, "the gateway runs a single process: it cannot reload")
        gw_log = sup.logs / "gateway.log"
        offset = gw_log.stat().st_size if gw_log.exists() else 0
        sup.gateway.write_config(plan.new)
        try:
            generation = await self._sighup_and_wait(proc, before, gw_log, offset)
        except ReloadError:
            sup.gateway.write_config(plan.old)  # nothing changed
            raise
        warnings = await self._apply_admin(plan)
        sup.spec = self._applied_spec(plan.spec, plan.gateway)
        sup.record(
            "gateway_reloaded",
            generation=generation,
            changed=[c["key"] for c in plan.changed],
            not_applied=[c["key"] for c in plan.not_applied],
        )
        log.info(
            "gateway reloaded (generation %d): %d setting(s) changed, %d not applied",
            generation,
            len(plan.changed),
            len(plan.not_applied),
        )
        return {
            "ok": True,
            "spec": str(sup.spec_path) if sup.spec_path else None,
            "gateway_pid": proc.pid,
            "generation": generation,
            "changed": plan.changed,
            "not_applied": plan.not_applied,
            "warnings": warnings,
        }

    async def _apply_admin(self, plan: _Plan) -> list[str]:
        """Routes and pool caps, which the gateway's main process keeps across a SIGHUP: set
        through its admin API (a failure is a warning: the new workers serve already)."""
        sup = self.sup
        warnings: list[str] = []
        if plan.old.routes != plan.new.routes:
            try:
                await sup.admin.set_routes(routes={k: list(v) for k, v in plan.new.routes.items()})
            except AdminError as e:
                warnings.append(f"gateway.routes not applied: {e}")
        for name, update in plan.pools.items():
            pool = sup.pool_spec(name)
            assert pool is not None
            sup.set_pool(pool.model_copy(update=update))
            for r in list(sup.replicas.values()):
                if r.pool.name != name:
                    continue
                r.pool = r.pool.model_copy(update=update)  # what a re-registration sends
                if "cap" not in update:
                    continue
                cap = update["cap"]
                if r.alive and not r.stopping:
                    try:
                        await sup.admin.set_cap(name=r.name, cap=cap)
                    except AdminError as e:
                        warnings.append(f"pools.{name}.cap not applied to {r.name}: {e}")
        return warnings

    async def _sighup_and_wait(self, proc: Proc, before: int, gw_log: Path, offset: int) -> int:
        """SIGHUP the gateway and wait until its new generation of workers serves; the
        gateway's own reason (from its log) when it gives up and keeps the old ones."""
        try:
            proc.send_signal(signal.SIGHUP)
        except ProcessLookupError:
            raise ReloadError(503, "the gateway exited; the supervisor restarts it") from None
        deadline = time.monotonic() + RELOAD_TIMEOUT_S
        while True:
            await asyncio.sleep(0.1)
            if proc.returncode is not None:
                raise ReloadError(
                    500, f"the gateway exited ({proc.returncode}) during the reload; log: {gw_log}"
                )
            with contextlib.suppress(AdminError):
                gen = (await self.sup.admin.status()).get("workers", {}).get("generation")
                if isinstance(gen, int) and gen > before:
                    return gen
            if failed := _reload_failure(gw_log, offset):
                raise ReloadError(500, f"the gateway kept its old workers: {failed}; log: {gw_log}")
            if time.monotonic() > deadline:
                raise ReloadError(
                    500,
                    f"the gateway's new workers did not serve within {RELOAD_TIMEOUT_S:.0f} s; "
                    f"log: {gw_log}",
                )
