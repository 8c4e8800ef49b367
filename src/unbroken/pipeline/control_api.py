"""The supervisor's control API: HTTP on a Unix socket (STATE/supervisor.sock, 0600).

The routes are the HTTP face of the supervisor's own methods: `GET /status`, `GET /events`,
`GET /pools` (what the autoscaler reads every interval), `POST /rollout` (progress streamed as
NDJSON, then a summary), `POST /convert` and `POST /scale` (the controller's dynamic
precision and autoscaler; they answer when done), `POST /drain` (`unbroken drain` of one of
its replicas: drained, stopped and replaced) and `POST /reload`. Rollouts, conversions,
scaling and reloads run one at a time: a second one is refused with 409. Every request gets
an answer, whatever failed. The client is `pipeline/control.py`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from unbroken.pipeline.drain import NoSuchReplica
from unbroken.pipeline.reload import ReloadError
from unbroken.pipeline.rollout import Progress, RolloutError, RolloutRequest

if TYPE_CHECKING:
    from unbroken.pipeline.supervisor import Supervisor

__all__ = ["ControlServer"]

log = logging.getLogger("unbroken.pipeline")


def _brief(ev: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in ev.items() if k not in ("event", "t"))


def _error(message: str, status: int) -> web.Response:
    """The answer of /convert and /scale on a refusal: the admin API's error shape."""
    return web.json_response({"error": {"message": message}}, status=status)


class ControlServer:
    def __init__(self, sup: Supervisor, socket: Path) -> None:
        self.sup = sup
        self.socket = socket
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()
        app = web.Application()
        app.router.add_get("/status", self.status)
        app.router.add_get("/events", self.events)
        app.router.add_post("/rollout", self.rollout)
        app.router.add_post("/convert", self.convert)
        app.router.add_post("/scale", self.scale)
        app.router.add_get("/pools", self.pools)
        app.router.add_post("/reload", self.reload)
        app.router.add_post("/drain", self.drain)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.UnixSite(self._runner, str(self.socket)).start()
        os.chmod(self.socket, 0o600)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def status(self, request: web.Request) -> web.Response:
        return web.Response(
            text=json.dumps(await self.sup.status()), content_type="application/json"
        )

    async def events(self, request: web.Request) -> web.Response:
        return web.json_response({"events": self.sup.events})

    async def pools(self, request: web.Request) -> web.Response:
        """The pools as the autoscaler needs them, without asking the gateway: cheap enough
        to read every scaling interval."""
        return web.json_response(self.sup.pools_summary())

    async def rollout(self, request: web.Request) -> web.StreamResponse:
        from pydantic import ValidationError

        try:
            req = RolloutRequest.model_validate_json(await request.read())
        except ValidationError as e:
            return web.json_response({"error": str(e)}, status=400)
        if self.sup.busy:
            msg = "a rollout, conversion or reload is already running"
            return web.json_response({"error": msg}, status=409)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)

        async def progress(ev: dict[str, Any]) -> None:
            with contextlib.suppress(ConnectionError):
                await resp.write(json.dumps(ev).encode() + b"\n")

        try:
            summary = await self.sup.rollout(req, progress)
        except RolloutError as e:
            summary = {"ok": False, "error": str(e), "steps": []}
        except Exception as e:  # the caller gets a summary, whatever happened
            log.exception("rollout of %s failed", req.pool)
            summary = {
                "ok": False,
                "error": f"the rollout failed unexpectedly: {type(e).__name__}: {e}",
                "steps": [],
            }
        await progress({"event": "summary", **summary})
        await resp.write_eof()
        return resp

    async def _change(
        self,
        request: web.Request,
        model: type[Any],
        run: Callable[[Any, Progress], Awaitable[dict[str, Any]]],
        what: Callable[[Any], str],
        say: Callable[[Any, dict[str, Any]], None],
    ) -> web.Response:
        """A conversion or a resize: validate, refuse while another change runs (409), run,
        answer its summary when done; a bad request is 400, an unexpected failure a summary
        that says so."""
        from pydantic import ValidationError

        try:
            req = model.model_validate_json(await request.read())
        except ValidationError as e:
            return _error(str(e), 400)
        if self.sup.busy:
            return _error("a rollout, conversion, scaling or reload is already running", 409)

        async def progress(ev: dict[str, Any]) -> None:
            say(req, ev)

        try:
            summary = await run(req, progress)
        except RolloutError as e:
            return _error(str(e), 400)
        except NoSuchReplica as e:
            return _error(f"no replica named {e.args[0]!r} in this pipeline", 404)
        except Exception as e:
            log.exception("%s failed", what(req))
            summary = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return web.json_response(summary)

    async def convert(self, request: web.Request) -> web.Response:
        """Move one replica to another pool (dynamic precision); answers when done."""
        from unbroken.pipeline.convert import ConvertRequest

        def say(req: Any, ev: dict[str, Any]) -> None:
            detail = ev.get("reason") or ev.get("new") or ""
            log.info("convert %s -> %s: %s %s", req.endpoint, req.to_pool, ev["event"], detail)

        return await self._change(
            request, ConvertRequest, self.sup.convert, lambda r: f"conversion of {r.endpoint}", say
        )

    async def scale(self, request: web.Request) -> web.Response:
        """Resize an autoscaled pool (the controller's autoscaler); answers when done."""
        from unbroken.pipeline.scale import ScaleRequest

        def say(req: Any, ev: dict[str, Any]) -> None:
            if ev["event"] in ("started", "finished", "rollback", "drain_failed"):
                log.info("scale %s: %s %s", req.pool, ev["event"], _brief(ev))

        return await self._change(
            request, ScaleRequest, self.sup.scale, lambda r: f"scaling of {r.pool}", say
        )

    async def drain(self, request: web.Request) -> web.Response:
        """`unbroken drain REPLICA`: drain one of the supervisor's replicas and replace it;
        answers when the replica has stopped and its successor serves (or retries). 404 for a
        name that is not one of its replicas (the CLI then drains it in the gateway alone)."""
        from unbroken.pipeline.drain import DrainRequest

        def say(req: Any, ev: dict[str, Any]) -> None:
            log.info("drain %s: %s %s", req.replica, ev["event"], _brief(ev))

        return await self._change(
            request, DrainRequest, self.sup.drain, lambda r: f"drain of {r.replica}", say
        )

    async def reload(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(await self.sup.reload())
        except ReloadError as e:
            return web.json_response({"error": str(e)}, status=e.status)
        except Exception as e:  # the caller gets an answer, whatever happened
            log.exception("reload failed")
            msg = f"the reload failed unexpectedly: {type(e).__name__}: {e}"
            return web.json_response({"error": msg}, status=500)
