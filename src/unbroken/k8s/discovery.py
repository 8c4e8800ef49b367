"""A Service's endpoints from its EndpointSlices (`discovery.k8s.io/v1`), kept current with
lightkube: list, then watch from the list's resourceVersion; re-list at once on `410 Gone`
(the version fell out of the API server's window); on any other error (refused, reset,
dropped watch) keep the last known state, report the API as down and re-list after an
exponential back-off. This is the only module that talks to the Kubernetes API.

Each change hands the merged view of all the Service's slices to `on_change`, as
`{name: SliceEndpoint}`; the caller (the gateway's discovery) turns it into actions.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from lightkube import AsyncClient, KubeConfig
from lightkube.core.exceptions import ApiError
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
        self.slices: dict[str, list[SliceEndpoint]] = {}
        self.synced = False  # one list succeeded
        self.api_up = False

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

    async def run(self) -> None:
        delay = self.backoff[0]
        watched_at = -math.inf
        client: AsyncClient | None = None
        labels = {SERVICE_LABEL: self.ref.service}
        try:
            while True:
                watching = False
                try:
                    if client is None:
                        client = self.client_factory()
                    listing = client.list(
                        EndpointSlice, namespace=self.ref.namespace, labels=labels
                    )
                    slices = {}
                    async for obj in listing:
                        slices[obj.metadata.name] = slice_endpoints(obj, self.ref.port)
                    version = listing.resourceVersion
                    self.slices, self.synced = slices, True
                    self._api(True, None)
                    self._emit()
                    if time.monotonic() - watched_at > 1.0:
                        delay = self.backoff[0]
                    watching, watched_at = True, time.monotonic()
                    idle = self.server_timeout_s + 30
                    async with asyncio.timeout(idle) as tmo:
                        async for kind, obj in client.watch(
                            EndpointSlice,
                            namespace=self.ref.namespace,
                            labels=labels,
                            resource_version=version,
                            server_timeout=self.server_timeout_s,
                        ):
                            tmo.reschedule(asyncio.get_running_loop().time() + idle)
                            if kind == "DELETED":
                                self.slices.pop(obj.metadata.name, None)
                            elif kind in ("ADDED", "MODIFIED"):
                                self.slices[obj.metadata.name] = slice_endpoints(obj, self.ref.port)
                            else:  # BOOKMARK
                                continue
                            self._emit()
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    if _gone(e):
                        log.info("watch of %s: 410 Gone, listing again", self.ref)
                        self.on_api(True, "gone")
                        if time.monotonic() - watched_at < 1.0:  # gone at once: not a hot loop
                            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                            delay = min(delay * 2, self.backoff[1])
                        continue
                    if isinstance(e, TimeoutError):
                        # No event for server_timeout_s + 30 s. lightkube renews a watch the
                        # server ended by itself, from the last version, without a word, and
                        # sets no read timeout: so this list is what bounds how long a
                        # half-open connection could hide changes (a quiet Service is listed
                        # again every ~270 s; a busy one's watch lives on).
                        self.on_api(True, "timeout")
                        continue
                    if client is not None:
                        await _close(client)
                        client = None
                    if watching:
                        # A watch cut mid-stream (restart, load balancer): list again, at once
                        # unless watches keep breaking; only a failing list means unreachable.
                        log.info("watch of %s broke (%s): listing again", self.ref, e)
                        self.on_api(True, "dropped")
                        if time.monotonic() - watched_at < 1.0:
                            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                            delay = min(delay * 2, self.backoff[1])
                        continue
                    self._api(False, "error")
                    log.warning("EndpointSlices of %s: %s: %s", self.ref, type(e).__name__, e)
                    await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                    delay = min(delay * 2, self.backoff[1])
        finally:
            if client is not None:
                await _close(client)


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
