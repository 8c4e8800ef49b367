"""A Service's endpoints from its EndpointSlices (`discovery.k8s.io/v1`), kept current with
lightkube: list, then watch from the list's resourceVersion, asking for bookmarks so that the
version keeps up while the Service is quiet; when the server ends a watch (timeoutSeconds),
watch again from the last version seen, without a list. `410 Gone` (the version fell out of
the API server's window) and a broken watch lead to a list; a failing list keeps the last
known state, reports the API as down and backs off exponentially; so do watches that keep
failing right after their list. This is the only module that talks to the Kubernetes API.

Each change hands the merged view of all the Service's slices to `on_change`, as
`{name: SliceEndpoint}`; the caller (the gateway's discovery) turns it into actions.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from lightkube import AsyncClient, KubeConfig
from lightkube.core import decoders
from lightkube.core.exceptions import ApiError
from lightkube.core.internal_models import meta_v1
from lightkube.resources.discovery_v1 import EndpointSlice

from unbroken.k8s.hooks import endpoint_name

__all__ = [
    "K8sSettings",
    "ServiceRef",
    "SliceEndpoint",
    "SliceWatcher",
    "default_client",
    "gateway_settings",
    "parse_service_ref",
]

log = logging.getLogger("unbroken.k8s.discovery")

SERVICE_LABEL = "kubernetes.io/service-name"


@dataclass(frozen=True)
class ServiceRef:
    namespace: str
    service: str
    port: str | None = None  # port name in the slice; None: the first port

    def __str__(self) -> str:
        return f"{self.namespace}/{self.service}" + (f":{self.port}" if self.port else "")


def parse_service_ref(text: str) -> ServiceRef:
    """`NAMESPACE/SERVICE[:PORTNAME]`."""
    ns, sep, rest = text.partition("/")
    svc, _, port = rest.partition(":")
    if not sep or not ns or not svc:
        raise ValueError(f"{text!r}: expected NAMESPACE/SERVICE[:PORTNAME]")
    return ServiceRef(ns, svc, port or None)


@dataclass(frozen=True)
class SliceEndpoint:
    name: str
    url: str
    ready: bool
    serving: bool
    terminating: bool


def default_client() -> AsyncClient:
    """In-cluster service account first, then `KUBECONFIG`, then ~/.kube/config."""
    return AsyncClient(config=KubeConfig.from_env())


@dataclass
class K8sSettings:
    """What the gateway discovers: its pools' Services, and its own Service for cap shares."""

    services: dict[str, ServiceRef]  # pool → Service of its engines
    peers: ServiceRef | None = None  # the gateway's own Service
    pod: str | None = None  # this replica's endpoint name among the peers (pod.namespace)
    pool_caps: dict[str, int] = field(default_factory=dict)  # engine cap, all replicas together
    client_factory: Callable[[], AsyncClient] = default_client


def gateway_settings(
    services: list[str],
    peers: str | None,
    pool_caps: list[str],
    pod_name: str | None,
    pod_namespace: str | None,
) -> K8sSettings:
    """From the gateway's options: `POOL=NS/SVC[:PORT]`..., `NS/SVC`, `POOL=N`...; ValueError
    with the offending option."""
    refs: dict[str, ServiceRef] = {}
    for item in services:
        pool, sep, ref = item.partition("=")
        if not sep or not pool:
            raise ValueError(f"--k8s-service {item!r}: expected POOL=NAMESPACE/SERVICE[:PORT]")
        refs[pool] = parse_service_ref(ref)
    caps: dict[str, int] = {}
    for item in pool_caps:
        pool, _, n = item.partition("=")
        if not pool or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--pool-cap {item!r}: expected POOL=N with N >= 1")
        caps[pool] = int(n)
    if peers is not None and not pod_name:
        raise ValueError("--k8s-peers needs this pod's name (--pod-name or POD_NAME)")
    return K8sSettings(
        services=refs,
        peers=parse_service_ref(peers) if peers else None,
        pod=endpoint_name(pod_name, pod_namespace) if pod_name else None,
        pool_caps=caps,
    )


def slice_endpoints(obj: Any, port_name: str | None) -> list[SliceEndpoint]:
    """The endpoints of one slice. Unknown `ready` counts as ready and unknown `serving` as
    `ready`, as the API documents; unknown `terminating` as not terminating."""
    ports = [p for p in obj.ports or [] if p.port is not None]
    if port_name is not None:
        ports = [p for p in ports if p.name == port_name]
    if not ports:
        return []
    port = ports[0].port
    out = []
    for ep in obj.endpoints or []:
        if not ep.addresses:
            continue
        addr = ep.addresses[0]
        host = f"[{addr}]" if ":" in addr else addr
        c = ep.conditions
        ready = True if c is None or c.ready is None else bool(c.ready)
        serving = ready if c is None or c.serving is None else bool(c.serving)
        terminating = bool(c is not None and c.terminating)
        ref = ep.targetRef
        if ref is not None and ref.kind == "Pod" and ref.name:
            name = endpoint_name(ref.name, ref.namespace or obj.metadata.namespace)
        else:
            name = f"{addr}:{port}"
        out.append(SliceEndpoint(name, f"http://{host}:{port}", ready, serving, terminating))
    return out


def merge(slices: Iterable[list[SliceEndpoint]]) -> dict[str, SliceEndpoint]:
    """During a slice rewrite an endpoint may sit in two slices: the readier entry wins."""
    out: dict[str, SliceEndpoint] = {}
    for eps in slices:
        for e in eps:
            old = out.get(e.name)
            if old is None or (e.ready, not e.terminating) > (old.ready, not old.terminating):
                out[e.name] = e
    return out


class _BookmarkMeta(msgspec.Struct):
    resourceVersion: str | None = None


class _Bookmark(msgspec.Struct):
    """A BOOKMARK's object: only `metadata.resourceVersion` is promised, the rest may be
    missing (the docs' form), so it is not decoded as an EndpointSlice."""

    metadata: _BookmarkMeta | None = None


FAILING = 3  # watches in a row that fail at once before the API is reported down


class SliceWatcher:
    def __init__(
        self,
        ref: ServiceRef,
        on_change: Callable[[dict[str, SliceEndpoint]], None],
        *,
        client_factory: Callable[[], AsyncClient] = default_client,
        on_api: Callable[[bool, str | None], None] = lambda up, why: None,
        backoff: tuple[float, float] = (0.5, 30.0),
        server_timeout_s: int = 240,
    ) -> None:
        self.ref = ref
        self.on_change = on_change
        self.on_api = on_api  # (reachable, reason for a restart)
        self.client_factory = client_factory
        self.backoff = backoff
        self.server_timeout_s = server_timeout_s
        # A watch that lived this long, or delivered an event, is healthy: the back-off
        # resets. Half the server's timeout when that is short, so a watch the server ends
        # on time always counts as healthy.
        self.healthy_s = min(10.0, server_timeout_s / 2)
        self.slices: dict[str, list[SliceEndpoint]] = {}
        self.version: str | None = None  # the last version seen; None: list first
        self.synced = False  # one list succeeded
        self.api_up = False
        self._delay = backoff[0]
        self._fails = 0  # watches in a row that failed (or ended) at once
        self._healthy = False  # the current watch lived healthy_s or delivered an event

    @property
    def endpoints(self) -> dict[str, SliceEndpoint]:
        return merge(self.slices.values())

    def _emit(self) -> None:
        self.on_change(self.endpoints)

    def _api(self, up: bool, why: str | None) -> None:
        if up != self.api_up:
            log.log(
                logging.INFO if up else logging.WARNING,
                "Kubernetes API for %s %s%s",
                self.ref,
                "reachable" if up else "unreachable, serving the last known endpoints",
                f" ({why})" if why else "",
            )
        self.api_up = up
        self.on_api(up, why)

    def _restart(self, why: str) -> None:
        """Count a restart without changing whether the API is up."""
        self.on_api(self.api_up, why)

    def _mark_healthy(self) -> None:
        if self._healthy:
            return
        self._healthy = True
        self._fails, self._delay = 0, self.backoff[0]
        if not self.api_up:
            self._api(True, None)

    async def _backoff(self) -> None:
        await asyncio.sleep(self._delay * random.uniform(0.8, 1.2))
        self._delay = min(self._delay * 2, self.backoff[1])

    async def _failed_at_once(self, why: str) -> None:
        """A watch that failed (or ended) before it was healthy: back off, and after FAILING
        in a row report the API as down, even though each list succeeds."""
        self._fails += 1
        if self._fails >= FAILING:
            self._api(False, "watch failing")
        else:
            self._restart(why)
        await self._backoff()

    async def _list(self, client: AsyncClient) -> None:
        # A quorum list, not resourceVersion="0" (served from the API server's watch cache,
        # as client-go's reflector does): that cache may lag behind what this replica has
        # already seen (another API server, right after a 410), and with bookmarks a list
        # happens only at start, after a 410 or a broken watch, of one Service's few slices.
        listing = client.list(
            EndpointSlice, namespace=self.ref.namespace, labels={SERVICE_LABEL: self.ref.service}
        )
        slices = {}
        async for obj in listing:
            slices[obj.metadata.name] = slice_endpoints(obj, self.ref.port)
        self.slices, self.synced, self.version = slices, True, listing.resourceVersion
        if self._fails < FAILING:  # a list that works while every watch fails: still down
            self._api(True, None)
        self._emit()

    async def _watch(self, client: AsyncClient) -> None:
        """One WATCH request from `self.version`, until the server ends it (timeoutSeconds).

        Our own loop over lightkube's request machinery (config, auth, TLS), because
        `AsyncClient.watch` neither asks for bookmarks nor survives one: it decodes every
        event as a full EndpointSlice, and a bookmark carries only metadata.resourceVersion.
        Without bookmarks a quiet Service's watch is renewed from the list's version until
        that is compacted (a 410 and a list every few minutes)."""
        gc = client._client
        br = gc.prepare_request(
            "list",
            res=EndpointSlice,
            namespace=self.ref.namespace,
            watch=True,
            params={
                "timeoutSeconds": str(self.server_timeout_s),
                "resourceVersion": self.version,
                "allowWatchBookmarks": "true",
                "labelSelector": f"{SERVICE_LABEL}={self.ref.service}",
            },
        )
        req = gc._client.build_request(
            br.method, br.url, params=br.params, timeout=gc._watch_timeout
        )
        loop = asyncio.get_running_loop()
        healthy = loop.call_later(self.healthy_s, self._mark_healthy)
        # lightkube sets no read timeout on a watch: this idle deadline (each line restarts
        # it) is what finds a half-open connection.
        idle = self.server_timeout_s + 30
        try:
            async with asyncio.timeout(idle) as tmo:
                resp = await gc.send(req, stream=True)
                try:
                    if not resp.is_success:
                        raise _status_error(resp.status_code, await resp.aread())
                    async for line in resp.aiter_lines():
                        tmo.reschedule(loop.time() + idle)
                        if line.strip():
                            self._event(line)
                finally:
                    await resp.aclose()
        finally:
            healthy.cancel()

    def _event(self, line: str) -> None:
        ev = decoders.decode_watch_event(line)
        if ev.type == "ERROR":
            raise ApiError(status=decoders.decode_status(ev.object))
        if ev.type == "BOOKMARK":
            bm = msgspec.json.decode(ev.object, type=_Bookmark)
            if bm.metadata is not None and bm.metadata.resourceVersion:
                self.version = bm.metadata.resourceVersion
            self._mark_healthy()
            return
        if ev.type not in ("ADDED", "MODIFIED", "DELETED"):
            return
        obj = decoders.decode_object(ev.object, EndpointSlice)
        if ev.type == "DELETED":
            self.slices.pop(obj.metadata.name, None)
        else:
            self.slices[obj.metadata.name] = slice_endpoints(obj, self.ref.port)
        self.version = obj.metadata.resourceVersion or self.version
        self._mark_healthy()
        self._emit()

    async def run(self) -> None:
        client: AsyncClient | None = None
        try:
            while True:
                watching = False
                try:
                    if client is None:
                        client = self.client_factory()
                    if self.version is None:
                        await self._list(client)
                    watching, self._healthy = True, False
                    await self._watch(client)
                    # The server ended it (timeoutSeconds): watch on from the last version
                    # seen, without a list; at once unless it ended before it was healthy.
                    if not self._healthy:
                        await self._failed_at_once("ended")
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    if not watching:
                        if client is not None:
                            await _close(client)
                            client = None
                        self._api(False, "error")
                        log.warning("EndpointSlices of %s: %s: %s", self.ref, type(e).__name__, e)
                        await self._backoff()
                        continue
                    if isinstance(e, TimeoutError):
                        # No line for server_timeout_s + 30 s: a half-open connection. The
                        # version is still good: watch again from it, no list needed.
                        why = "timeout"
                    elif _gone(e):
                        log.info("watch of %s: 410 Gone, listing again", self.ref)
                        self.version, why = None, "gone"
                    else:
                        # Cut mid-stream (restart, load balancer) or refused: list again.
                        log.info("watch of %s broke (%s): listing again", self.ref, e)
                        self.version, why = None, "dropped"
                        if client is not None:
                            await _close(client)
                            client = None
                    if self._healthy:
                        self._restart(why)
                    else:  # failing at once: back off, whatever the cause
                        await self._failed_at_once(why)
        finally:
            if client is not None:
                await _close(client)


def _status_error(code: int, body: bytes) -> ApiError:
    """A watch refused with a non-2xx answer, as the ApiError its Status body describes (a
    410 then leads to a list like an ERROR event does)."""
    try:
        status = decoders.decode_status(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        status = meta_v1.Status(code=code, message=body[:200].decode(errors="replace"))
    if status.code is None:
        status.code = code
    return ApiError(status=status)


def _gone(e: Exception) -> bool:
    if isinstance(e, ApiError):
        return e.status.code == 410
    # A watch refused with HTTP 410 (not an ERROR event) raises the HTTP client's status error.
    return getattr(getattr(e, "response", None), "status_code", None) == 410


async def _close(client: AsyncClient) -> None:
    try:
        await client.close()
    except Exception as e:  # closing a broken client must not stop the loop
        log.debug("closing the Kubernetes client: %s", e)
