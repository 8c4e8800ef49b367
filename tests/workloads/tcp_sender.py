"""Send to 127.0.0.1:PORT for SECONDS: `fast` fills the socket as fast as the peer allows
(non-blocking, waiting for writability like asyncio), `paced` sends 1 KiB every 10 ms."""

import select
import socket
import sys
import time

port, mode, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
s = socket.create_connection(("127.0.0.1", port))
s.setblocking(False)
chunk = b"x" * (16384 if mode == "fast" else 1024)
end = time.monotonic() + seconds
while time.monotonic() < end:
    if mode == "fast":
        select.select([], [s], [], 0.05)
        try:
            s.send(chunk)
        except BlockingIOError:
            pass
    else:
        try:
            s.send(chunk)
        except BlockingIOError:
            pass
        time.sleep(0.01)
s.close()
