"""TCP senders for the agent's backpressure tests (blocking sockets, kernel-default autotuned
buffers: no SO_SNDBUF or SO_RCVBUF).

  stream PORT SECONDS   8 KiB every 10 ms (an engine streaming tokens) for SECONDS
  burst PORT IDLE       2 MiB at once (blocks while the peer does not read), IDLE seconds of
                        nothing, one 100-byte write, 2 s, close
  stall PORT SECONDS    write as much as fits for SECONDS (non-blocking), then exit with data
                        still queued
  two PORT              two connections: A kept full (non-blocking writes until EAGAIN, every
                        50 ms; its peer never reads), B 200 bytes every 100 ms; 6 s
"""

import select
import socket
import sys
import time

mode, port = sys.argv[1], int(sys.argv[2])
s = socket.create_connection(("127.0.0.1", port))
if mode == "stream":
    end = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < end:
        s.sendall(b"x" * 8192)
        time.sleep(0.01)
elif mode == "burst":
    s.sendall(b"x" * (2 << 20))
    time.sleep(float(sys.argv[3]))
    s.sendall(b"y" * 100)
    time.sleep(2)
elif mode == "stall":
    s.setblocking(False)
    end = time.monotonic() + float(sys.argv[3])
    while time.monotonic() < end:
        select.select([], [s], [], 0.05)
        try:
            s.send(b"x" * 65536)
        except BlockingIOError:
            pass
elif mode == "two":
    b = socket.create_connection(("127.0.0.1", port))
    s.setblocking(False)
    end = time.monotonic() + 6
    while time.monotonic() < end:
        try:
            while True:
                s.send(b"x" * 16384)
        except BlockingIOError:
            pass
        b.sendall(b"y" * 200)
        time.sleep(0.1)
s.close()
