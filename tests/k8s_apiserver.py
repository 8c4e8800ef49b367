"""A stand-in Kubernetes API server for the discovery tests.

No real API server can run on our machines (no kind, k3s or etcd here), so the gateway's
EndpointSlice discovery is tested against this one: an aiohttp server in a background thread
that speaks the parts of the API the gateway uses, as a real server does:

- `GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=K=V`: a list
  with `metadata.resourceVersion`;
- the same with `watch=true&resourceVersion=RV`: a chunked stream of JSON lines
  `{"type": "ADDED"|"MODIFIED"|"DELETED", "object": ...}` with every change after RV; a
  version older than the compaction point answers `410 Gone` (as a Status ERROR event on an
  open watch, as HTTP 410 on a new one), which is the client's cue to list again;
- `timeoutSeconds` ends a watch cleanly, as the real server does;
- `allowWatchBookmarks=true`: the watch gets BOOKMARK events when the test calls `bookmark`,
  in the minimal form the Kubernetes docs show (an object with only `kind`, `apiVersion` and
  `metadata.resourceVersion`, the version the watch has reached); a watch that did not ask
  gets none.

The test drives it: `put_slice`, `delete_slice`, `compact` (410 for every watcher, or only
for new watches from older versions), `bookmark`, `fail_watches` (every new watch refused
with that HTTP status), `drop_watches` (cut open watch connections mid-stream),
`stop`/`start` (unreachable).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from unbroken.wire.http import free_port

__all__ = ["ApiServer", "Ep"]


@dataclass(frozen=True)
class Ep:
    """One endpoint of a slice: a pod's address and its conditions."""

    pod: str
    ip: str = "127.0.0.1"
    ready: bool = True
    serving: bool | None = None
    terminating: bool = False


class ApiServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.rv = 1
        self.compacted = 0  # watches from a version below this get 410
        self.slices: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.lists = 0
        self.watches: list[str | None] = []  # resourceVersion of each watch request
        self.watch_params: list[dict[str, str]] = []  # the query of each watch request
        self.fail_watches: tuple[int, str] | None = None  # (code, reason): refuse new watches
        self._bookmarks = 0  # bookmark() calls so far
        self._cuts = 0  # compact() calls that cut open watches
        self._cond: asyncio.Condition | None = None
        self._open: dict[int, web.Request] = {}  # id → open watch request
        self._runner: web.AppRunner | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._init())
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            orjson.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
                    "users": [{"name": "test", "user": {"token": "stand-in"}}],
                    "contexts": [
                        {"name": "test", "context": {"cluster": "stand-in", "user": "test"}}
                    ],
                    "current-context": "test",
                }
            ).decode()
        )
        return path

    # -- driving it from the test thread ------------------------------------------------
    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _init(self) -> None:
        self._cond = asyncio.Condition()

    def start(self) -> None:
        self._call(self._start())

    def stop(self) -> None:
        """Unreachable: the listener closes and open watches are cut."""
        self._call(self._stop())

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def put_slice(
        self, namespace: str, name: str, service: str, eps: Iterable[Ep], port: int, port_name: str
    ) -> None:
        obj = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"kubernetes.io/service-name": service},
            },
            "addressType": "IPv4",
            "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
            "endpoints": [
                {
                    "addresses": [e.ip],
                    "conditions": {
                        "ready": e.ready,
                        "serving": e.ready if e.serving is None else e.serving,
                        "terminating": e.terminating,
                    },
                    "targetRef": {"kind": "Pod", "name": e.pod, "namespace": namespace},
                }
                for e in eps
            ],
        }
        self._call(self._change("MODIFIED" if (namespace, name) in self.slices else "ADDED", obj))

    def delete_slice(self, namespace: str, name: str) -> None:
        obj = self.slices[(namespace, name)]
        self._call(self._change("DELETED", obj))

    def compact(self, cut_watches: bool = True) -> None:
        """Every version so far falls out of the window: a new watch from one gets HTTP 410;
        with `cut_watches` open watches get an ERROR 410 too, else they go on (as the real
        server's watch cache does: a new watch from the current version is fine)."""
        self._call(self._compact(cut_watches))

    def bookmark(self) -> None:
        """Send a BOOKMARK to every open watch that asked for bookmarks."""
        self._call(self._bookmark())

    def drop_watches(self) -> None:
        """Cut every open watch connection mid-stream (a load balancer or server restart)."""
        self._call(self._drop())

    # -- inside the loop -----------------------------------------------------------------
    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get(
            "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", self._endpointslices
        )
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def _stop(self) -> None:
        await self._drop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _change(self, kind: str, obj: dict[str, Any]) -> None:
        assert self._cond is not None
        self.rv += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if kind == "DELETED":
            self.slices.pop(key, None)
        else:
            self.slices[key] = obj
        self.events.append((self.rv, kind, obj))
        async with self._cond:
            self._cond.notify_all()

    async def _compact(self, cut_watches: bool) -> None:
        assert self._cond is not None
        if cut_watches:
            self.rv += 1
            self._cuts += 1
        self.compacted = self.rv
        async with self._cond:
            self._cond.notify_all()

    async def _bookmark(self) -> None:
        assert self._cond is not None
        self._bookmarks += 1
        async with self._cond:
            self._cond.notify_all()

    async def _drop(self) -> None:
        for request in list(self._open.values()):
            if request.transport is not None:
                request.transport.abort()
        self._open.clear()

    @staticmethod
    def _matches(obj: dict[str, Any], ns: str, selector: str | None) -> bool:
        if obj["metadata"]["namespace"] != ns:
            return False
        labels = obj["metadata"].get("labels", {})
        for term in filter(None, (selector or "").split(",")):
            k, _, v = term.partition("=")
            if labels.get(k) != v:
                return False
        return True

    @staticmethod
    def _status(code: int, reason: str, message: str) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason,
            "code": code,
        }

    async def _endpointslices(self, request: web.Request) -> web.StreamResponse:
        ns = request.match_info["ns"]
        q = request.query
        selector = q.get("labelSelector")
        if q.get("watch") not in ("true", "1"):
            self.lists += 1
            items = [o for o in self.slices.values() if self._matches(o, ns, selector)]
            body = {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": items,
            }
            return web.Response(body=orjson.dumps(body), content_type="application/json")
        since = q.get("resourceVersion")
        self.watches.append(since)
        self.watch_params.append(dict(q))
        if self.fail_watches is not None:
            code, reason = self.fail_watches
            err = self._status(code, reason, f"watch refused: {reason}")
            return web.json_response(err, status=code, dumps=lambda o: orjson.dumps(o).decode())
        start = int(since) if since else self.rv
        if start < self.compacted:
            gone = self._status(410, "Expired", f"too old resource version: {start}")
            return web.json_response(gone, status=410, dumps=lambda o: orjson.dumps(o).decode())
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        self._open[id(request)] = request
        timeout = float(q.get("timeoutSeconds", "300"))
        assert self._cond is not None
        seen = start
        cuts_seen = self._cuts
        bookmarks = q.get("allowWatchBookmarks") == "true"
        bookmarks_seen = self._bookmarks
        try:
            async with asyncio.timeout(timeout):
                while True:
                    if self._cuts > cuts_seen:
                        gone = self._status(410, "Expired", "too old resource version")
                        line = orjson.dumps({"type": "ERROR", "object": gone}) + b"\n"
                        await resp.write(line)
                        break
                    now = self.rv
                    for _rv, kind, obj in [e for e in self.events if seen < e[0] <= now]:
                        if self._matches(obj, ns, selector):
                            await resp.write(orjson.dumps({"type": kind, "object": obj}) + b"\n")
                    seen = now
                    if self._bookmarks > bookmarks_seen:
                        bookmarks_seen = self._bookmarks
                        if bookmarks:
                            bm = {
                                "kind": "EndpointSlice",
                                "apiVersion": "discovery.k8s.io/v1",
                                "metadata": {"resourceVersion": str(now)},
                            }
                            line = {"type": "BOOKMARK", "object": bm}
                            await resp.write(orjson.dumps(line) + b"\n")
                    async with self._cond:
                        await self._cond.wait_for(
                            lambda: self.rv > seen or self._bookmarks > bookmarks_seen  # noqa: B023
                        )
        except TimeoutError:
            pass
        except ConnectionError:
            return resp
        finally:
            self._open.pop(id(request), None)
        try:
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp
