"""The listening socket, from orphaned workers to a new main process.

When the main process dies (kill -9), its workers keep serving on the listening socket they
inherited and offer it at a known path: one Unix socket per worker in `takeover_dir(port)`.
A new main process (the supervisor's restart) takes it from there (`SCM_RIGHTS`) instead of
binding, so the kernel's accept queue is the same before, during and after the restart and
no connection is refused or reset. An orphan that has given it away drains and exits.

Apart from `_handover` (streams moved between workers at a reload) because it is another
exchange between other processes: a worker (`offer_listener`) and the next main process
(`take_listener`), about the socket, not about streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

__all__ = ["offer_listener", "take_listener", "takeover_dir"]

log = logging.getLogger("unbroken.gateway.handover")


def takeover_dir(port: int) -> Path:
    """Where orphaned workers of the gateway on `port` offer their listening socket."""
    from unbroken.config.paths import state_dir

    return state_dir() / "gateway" / f"listen-{port}"


async def offer_listener(
    listen: socket.socket, port: int, given: Callable[[], None], taken: Callable[[], None]
) -> None:
    """Offer `listen` to the next main process until one takes it: `given` once it has the
    socket, `taken` once its workers serve (it closed the connection). Runs until then or
    cancelled; the offer's socket file is removed when it ends."""
    d = takeover_dir(port)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = d / f"{os.getpid()}.sock"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.setblocking(False)
    try:
        srv.bind(str(path))
        os.chmod(path, 0o600)
        srv.listen(4)
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(srv)
        with conn:
            conn.setblocking(True)
            conn.settimeout(2.0)
            socket.send_fds(conn, [b"L"], [listen.fileno()])
            log.warning("worker %d: a new main process took the listening socket", os.getpid())
            given()
            conn.setblocking(False)
            # Serve on until its workers serve too (it closes this connection then), so
            # that nothing waits in the accept queue meanwhile.
            with contextlib.suppress(OSError):
                await loop.sock_recv(conn, 1)
        taken()
    finally:
        srv.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def take_listener(port: int) -> tuple[socket.socket | None, list[socket.socket]]:
    """The listening socket on `port` from orphaned workers of a dead main process, or None
    (none offered it: bind a new one), and one connection per offering worker: each serves
    on until its connection is closed, then drains."""
    d = takeover_dir(port)
    got: socket.socket | None = None
    held: list[socket.socket] = []
    for path in sorted(d.glob("*.sock")) if d.is_dir() else []:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.settimeout(2.0)
        try:
            c.connect(str(path))
            _, fds, _, _ = socket.recv_fds(c, 1, 1)
        except OSError:  # its worker is gone: a stale file
            c.close()
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        held.append(c)
        for fd in fds:
            if got is None:
                got = socket.socket(fileno=fd)
            else:
                os.close(fd)  # the same socket again, from another worker
    return got, held
