"""The standard deployment's load balancer: an L4 round-robin TCP proxy, as a Kubernetes
Service is (kube-proxy in IPVS mode, whose default scheduler is round robin).

Each accepted connection goes to the next backend in the list and stays there for its life
(HTTP keep-alive included), bytes are relayed untouched both ways, and a backend that closes
or resets its side closes or resets the client's the same way. No health checks, no retries,
no knowledge of HTTP: what a team has without an L7 gateway. The backend list lives in a JSON
file (`{"backends": ["host:port", ...]}`), re-read on SIGHUP (an Endpoints update); existing
connections are left alone, as conntrack leaves them. After each reload the proxy writes the
file's `generation` into `<file>.ack`, so the caller knows when the update is in effect.

Run: `python -m unbroken.bench.rrproxy --listen 127.0.0.1:PORT --backends FILE`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
from pathlib import Path
from typing import cast

from unbroken.wire.heap import freeze_startup_heap

__all__ = ["RoundRobinProxy", "main"]

log = logging.getLogger("unbroken.rrproxy")
HIGH_WATER = 256 * 1024


class _Side(asyncio.Protocol):
    """One socket of a relayed pair; what it reads is written to its peer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] = []
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport.set_write_buffer_limits(high=HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.pending.append(data)
        elif not peer.closed:
            peer.transport.write(data)

    def eof_received(self) -> bool:
        peer = self.peer
        if peer is not None and peer.transport is not None and not peer.closed:
            if peer.transport.can_write_eof():
                peer.transport.write_eof()
                return True  # keep our side open for the reply (TCP half-close)
            peer.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        peer = self.peer
        if peer is not None and peer.transport is not None and not peer.closed:
            # A reset is passed on as a reset (the client sees what kube-proxy's NAT shows).
            if exc is not None:
                peer.transport.abort()
            else:
                peer.transport.close()

    # flow control: a slow reader on one side pauses reading on the other
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None and not self.peer.closed:
            self.peer.transport.resume_reading()


class _Client(_Side):
    def __init__(self, proxy: RoundRobinProxy) -> None:
        super().__init__()
        self.proxy = proxy

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.transport is not None
        self.transport.pause_reading()
        backend = self.proxy.pick()
        if backend is None:
            self.transport.abort()
            return
        task = asyncio.get_running_loop().create_task(self._connect(*backend))
        self.proxy.tasks.add(task)
        task.add_done_callback(self.proxy.tasks.discard)

    async def _connect(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        up = _Side()
        try:
            await loop.create_connection(lambda: up, host, port)
        except OSError:
            if self.transport is not None:
                self.transport.abort()  # connection refused travels on as a reset
            return
        assert up.transport is not None and self.transport is not None
        if self.closed:
            up.transport.close()
            return
        up.peer, self.peer = self, up
        for chunk in self.pending:
            up.transport.write(chunk)
        self.pending.clear()
        self.transport.resume_reading()


class RoundRobinProxy:
    def __init__(self, backends: list[str] | None = None) -> None:
        self.backends: list[tuple[str, int]] = [_addr(b) for b in backends or []]
        self._next = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.connections = 0
        self._server: asyncio.Server | None = None

    def set_backends(self, backends: list[str]) -> None:
        self.backends = [_addr(b) for b in backends]

    def pick(self) -> tuple[str, int] | None:
        if not self.backends:
            return None
        b = self.backends[self._next % len(self.backends)]
        self._next += 1
        self.connections += 1
        return b

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Client(self), host, port, reuse_address=True, backlog=1024
        )
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for t in list(self.tasks):
            t.cancel()


def _addr(s: str) -> tuple[str, int]:
    host, _, port = s.removeprefix("http://").rstrip("/").rpartition(":")
    return host, int(port)


def _load(path: Path) -> tuple[list[str], int]:
    data = json.loads(path.read_text())
    return list(data["backends"]), int(data.get("generation", 0))


async def _serve(listen: str, backends_file: Path) -> None:
    backends, gen = _load(backends_file)
    proxy = RoundRobinProxy(backends)
    host, port = _addr(listen)
    freeze_startup_heap()  # kube-proxy, which this stands in for, has no collector pauses
    await proxy.start(host, port)
    ack = backends_file.with_name(backends_file.name + ".ack")
    ack.write_text(str(gen))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def reload() -> None:
        try:
            backends, gen = _load(backends_file)
        except (OSError, ValueError, KeyError) as e:
            log.error("cannot reload %s: %s", backends_file, e)
            return
        proxy.set_backends(backends)
        ack.write_text(str(gen))

    loop.add_signal_handler(signal.SIGHUP, reload)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await proxy.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m unbroken.bench.rrproxy", description=__doc__)
    ap.add_argument("--listen", required=True, help="host:port")
    ap.add_argument("--backends", required=True, type=Path, help="JSON file of backends")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(_serve(args.listen, args.backends))


if __name__ == "__main__":
    main()
