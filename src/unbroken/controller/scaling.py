"""The autoscaler's loop under `unbroken up`: every scaling interval it reads the pools from
the supervisor (`GET /pools`: ranges, targets, live counts, whether a resize or rollout is
under way) and the demand signal from every gateway's /metrics (the same
`unbroken_gateway_pool_demand` a KEDA trigger reads on Kubernetes), asks `Autoscaler` what to
do, and sends each resize to the supervisor (`POST /scale`), which brings replicas in through
the surge path and out through drain and migration. Decisions are logged once with their
reason and numbers, kept in the controller's /decisions, and counted in its /metrics.

On Kubernetes there is no supervisor: KEDA or the HPA scale on the same metric
(docs/kubernetes.md)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from unbroken.clients import SupervisorClient, SupervisorError, SupervisorRejected
from unbroken.controller.actions import Decision
from unbroken.controller.autoscale import Autoscaler, PoolScaling, ScaleDecision

__all__ = ["ScalingLoop", "floor_carriers", "parse_demand"]

log = logging.getLogger("unbroken.controller.scaling")

DEMAND = "unbroken_gateway_pool_demand"
LIMITED_BACKOFF_S = 30.0


def parse_demand(text: str) -> dict[str, float]:
    """The pool demand samples of a Prometheus exposition (only those lines are read: the
    loop runs every half second)."""
    out: dict[str, float] = {}
    prefix = DEMAND + '{pool="'
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name, _, rest = line[len(prefix) :].partition('"')
        try:
            value = float(rest.rpartition("}")[2].split()[0])
        except (ValueError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def floor_carriers(pools: list[dict[str, Any]], floor: Callable[[str], int]) -> dict[str, str]:
    """Per model, the one pool that holds the controller's floor of full-precision replicas
    (`min_full_replicas`): the first pool of the model in spec order with a floor (a
    full-precision pool) and at least one replica by its own declaration (`min` >= 1, or a
    fixed count >= 1). The floor is there so that each model's critical work keeps a
    full-precision replica to go to; one pool per model is enough for that, and a pool
    declared `min: 0` sleeps as declared (a model whose full pools all may sleep gets no
    floor: its first request wakes one). Before, every full pool had the floor, so the
    README's `min: 0` pool of a second model was woken 2 s after the start and never slept."""
    out: dict[str, str] = {}
    for p in pools:
        least = p["autoscale"]["min"] if p.get("autoscale") else int(p.get("declared", 0))
        if floor(p["name"]) > 0 and least >= 1:
            out.setdefault(p["model"], p["name"])
    return out


class _Metrics:
    def __init__(self, r: CollectorRegistry) -> None:
        # Every pool, ranged or not: what an on-call alerts on as "a pool short" (a review as
        # an SRE found nothing to alert on for a replacement crash loop under `unbroken up`).
        self.replicas = Gauge(
            "unbroken_pipeline_replicas",
            "A pool's replicas under `unbroken up`, from the supervisor: declared (its size "
            "now) and live (serving and answering /health).",
            ["pool", "state"],
            registry=r,
        )
        self.desired = Gauge(
            "unbroken_autoscale_desired_replicas",
            "Replicas the autoscaler wants for the pool.",
            ["pool"],
            registry=r,
        )
        self.current = Gauge(
            "unbroken_autoscale_current_replicas",
            "Replicas of the pool serving now.",
            ["pool"],
            registry=r,
        )
        self.demand = Gauge(
            "unbroken_autoscale_demand",
            "The pool's demand summed over gateways (running sequences plus queued requests).",
            ["pool"],
            registry=r,
        )
        self.decisions = Counter(
            "unbroken_autoscale_decisions",
            "Resizes asked for, by direction and outcome.",
            ["pool", "direction", "outcome"],
            registry=r,
        )


class ScalingLoop:
    def __init__(
        self,
        socket_path: str,
        admin_urls: Callable[[], list[str]],
        admin_token: str,
        registry: CollectorRegistry,
        record: Callable[[list[Decision]], None],
        contended: Callable[[], dict[str, int]],
        floor: Callable[[str], int],
        converting: Callable[[], set[str]] | None = None,
    ) -> None:
        """`contended`: contended replicas per pool; `floor`: the controller's least
        replicas of a pool; `converting`: pools a dynamic-precision conversion is moving a
        replica between, or holds one of until it converts back (the autoscaler leaves them
        alone: one view of the pool, not two loops undoing each other)."""
        self.client = SupervisorClient(socket_path)
        self.admin_urls = admin_urls
        self.admin_token = admin_token
        self.metrics = _Metrics(registry)
        self.record = record
        self.contended = contended
        self.floor = floor
        self.converting = converting or (lambda: set())
        self.autoscaler: Autoscaler | None = None
        self._signature: tuple[Any, ...] = ()
        self._public: dict[str, str] = {}  # admin URL → the gateway's public URL
        self._running: set[str] = set()  # pools with a resize in flight from here
        self._tasks: set[asyncio.Task[None]] = set()
        self.interval_s = 0.5
        self.last: dict[str, Any] = {}
        self._said_down: set[str] = set()
        # A pool whose last scale-up the machine could not hold (memory): left alone this
        # long rather than asked again every cool-down.
        self._backoff: dict[str, float] = {}

    def _configure(self, pools: list[dict[str, Any]]) -> None:
        """(Re)build the autoscaler when the set of ranged pools or their settings change."""
        sig = tuple(
            (p["name"], p["model"], tuple(sorted(p["autoscale"].items())),
             tuple(sorted(p["scaling"].items())), p.get("cap"))
            for p in pools
            if p.get("autoscale")
        )  # fmt: skip
        if sig == self._signature:
            return
        self._signature = sig
        ranged = [p for p in pools if p.get("autoscale")]
        carriers = floor_carriers(pools, self.floor)
        specs = []
        for i, p in enumerate(pools):
            if not p.get("autoscale"):
                continue
            nxt = next(
                (q["name"] for q in pools[i + 1 :] if q["model"] == p["model"]),
                None,
            )
            sc = p["scaling"]
            specs.append(
                PoolScaling(
                    name=p["name"],
                    min=p["autoscale"]["min"],
                    max=p["autoscale"]["max"],
                    target=sc["target"],
                    # What a replica takes before the gateway moves work on: the spill's room.
                    cap=p.get("cap"),
                    tolerance=sc["tolerance"],
                    up_cooldown_s=sc["up_cooldown_s"],
                    down_quiet_s=sc["down_quiet_s"],
                    down_cooldown_s=sc["down_cooldown_s"],
                    floor=self.floor(p["name"]) if carriers.get(p["model"]) == p["name"] else 0,
                    spill_to=nxt if nxt in {q["name"] for q in ranged} else None,
                )
            )
        self.autoscaler = Autoscaler(specs)
        for spec in specs:  # at 0 from the start: `increase(...{outcome="failed"})` has data
            for direction in ("up", "down"):
                for outcome in ("done", "failed"):
                    self.metrics.decisions.labels(spec.name, direction, outcome)
        self.interval_s = min((p["scaling"]["interval_s"] for p in ranged), default=0.5)
        if specs:
            log.info(
                "autoscaling %s every %.0f ms",
                ", ".join(f"{s.name} [{s.min}, {s.max}] target {s.target:g}" for s in specs),
                self.interval_s * 1e3,
            )

    async def _public_url(self, session: aiohttp.ClientSession, admin: str) -> str | None:
        if admin in self._public:
            return self._public[admin]
        async with session.get(
            admin + "/admin/status", headers={"Authorization": f"Bearer {self.admin_token}"}
        ) as r:
            if r.status != 200:
                return None
            listen = (await r.json()).get("listen")
        if isinstance(listen, str):
            self._public[admin] = listen.replace("://0.0.0.0:", "://127.0.0.1:")
        return self._public.get(admin)

    async def _demand(self, session: aiohttp.ClientSession) -> dict[str, float] | None:
        """Summed over gateways; None if no gateway answered (then nothing is decided)."""
        total: dict[str, float] = {}
        answered = False
        for admin in self.admin_urls():
            try:
                url = await self._public_url(session, admin)
                if url is None:
                    continue
                async with session.get(url + "/metrics") as r:
                    if r.status != 200:
                        continue
                    text = await r.text()
            except (aiohttp.ClientError, TimeoutError, OSError):
                self._public.pop(admin, None)
                continue
            answered = True
            for k, v in parse_demand(text).items():
                total[k] = total.get(k, 0.0) + v
        return total if answered else None

    async def once(self, session: aiohttp.ClientSession) -> None:
        try:
            sup = await self.client.pools()
        except SupervisorError as e:
            if "supervisor" not in self._said_down:
                log.warning("autoscaler: the supervisor does not answer (%s); holding", e)
                self._said_down.add("supervisor")
            return
        self._said_down.discard("supervisor")
        pools = sup["pools"]
        for p in pools:
            self.metrics.replicas.labels(p["name"], "declared").set(p["declared"])
            self.metrics.replicas.labels(p["name"], "live").set(p["live"])
        self._configure(pools)
        a = self.autoscaler
        if a is None or not a.pools:
            self.interval_s = 5.0  # nothing to scale; a new pool needs a restart anyway
            return
        demand = await self._demand(session)
        if demand is None:
            return
        current = {p["name"]: int(p["live"]) for p in pools}
        declared = {p["name"]: int(p["declared"]) for p in pools}
        mono = time.monotonic()
        backing_off = {p for p, until in self._backoff.items() if until > mono}
        busy = set(self._running) | backing_off | (self.converting() & {p.name for p in a.pools})
        if sup.get("busy") or self._running:
            # The supervisor resizes one pool at a time (and never during a rollout,
            # conversion or reload): wait for it rather than be refused.
            busy |= {p.name for p in a.pools}
        # A pool whose declared size differs from its live count is mid-change (a replica
        # being replaced): judge it by what it will be.
        now_count = {n: max(current[n], declared[n]) for n in current}
        # A pool the supervisor could not grow (no memory for another replica) holds what
        # its live replicas hold: demand past that spills to its fallback.
        limited = {p: current[p] for p in backing_off if p in current}
        decisions = a.step(time.monotonic(), demand, now_count, self.contended(), busy, limited)
        for p in a.pools:
            self.metrics.desired.labels(p.name).set(a.desired(p.name))
            self.metrics.current.labels(p.name).set(current.get(p.name, 0))
            self.metrics.demand.labels(p.name).set(demand.get(p.name, 0.0))
        self.last = {
            "demand": demand,
            "current": current,
            "desired": {p.name: a.desired(p.name) for p in a.pools},
            "busy": sorted(busy),
        }
        if decisions:
            self._start(decisions)

    def _start(self, decisions: list[ScaleDecision]) -> None:
        """Send the resizes one after the other (the supervisor runs one at a time)."""
        for d in decisions:
            self._running.add(d.pool)
            self.record(
                [
                    Decision(
                        time.time(),
                        d.pool,
                        f"scale {d.direction} to {d.desired}",
                        d.reason,
                        {"from": d.current, "to": d.desired, "demand": d.demand},
                    )
                ]
            )

        async def go() -> None:
            for d in decisions:
                await self._send(d)

        t = asyncio.create_task(go())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _send(self, d: ScaleDecision) -> None:
        try:
            res = await self.client.scale(d.pool, d.desired, d.reason)
        except SupervisorRejected as e:
            res = {"ok": False, "error": f"HTTP {e.status}: {e.message}"}
        except SupervisorError as e:
            res = {"ok": False, "error": str(e)}
        finally:
            self._running.discard(d.pool)
        ok = bool(res.get("ok"))
        if res.get("limited"):
            self._backoff[d.pool] = time.monotonic() + LIMITED_BACKOFF_S
        self.metrics.decisions.labels(d.pool, d.direction, "done" if ok else "failed").inc()
        what = f"scale {d.direction} {'done' if ok else 'failed'}"
        why = (
            f"{d.current} -> {res.get('replicas')} in {res.get('seconds')} s"
            if ok
            else str(res.get("error") or res.get("errors"))
        )
        if res.get("limited"):
            why += f"; {res['limited']}"
        self.record([Decision(time.time(), d.pool, what, why, {"result": res})])

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            try:
                while not stop.is_set():
                    t0 = time.monotonic()
                    try:
                        await self.once(session)
                    except Exception:  # one bad read must not end the loop
                        log.exception("autoscaler window failed")
                    delay = max(0.0, self.interval_s - (time.monotonic() - t0))
                    try:
                        await asyncio.wait_for(stop.wait(), delay)
                    except TimeoutError:
                        pass
            finally:
                for t in list(self._tasks):
                    t.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
