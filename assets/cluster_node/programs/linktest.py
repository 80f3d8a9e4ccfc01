"""`fab check`'s link test where iperf3 is missing: a receiver that accepts `streams` connections and
counts what arrives after `omit` seconds (TCP's ramp-up), and a sender that writes 1 MiB blocks on each
for omit + seconds. The receiver's figure is the one reported.
  python -m cluster_node.programs.linktest serve PORT OMIT [STREAMS]      prints {"gbit": G, "streams": N}
  python -m cluster_node.programs.linktest send HOST PORT SECONDS [STREAMS]"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from typing import Optional, Sequence

BLOCK = 1 << 20


def serve(port: int, omit: float, streams: int = 1) -> dict:
    counted, lock = [0], threading.Lock()
    firsts: list[float] = []
    lasts: list[float] = []

    def drain(conn: socket.socket, start: float) -> None:
        with conn:
            while chunk := conn.recv(BLOCK):
                now = time.monotonic()
                if now - start >= omit:
                    with lock:
                        counted[0] += len(chunk)
                        if not firsts:
                            firsts.append(now)
                        lasts.append(now)

    with socket.create_server(("0.0.0.0", port), backlog=streams) as server:
        server.settimeout(30)
        threads: list[threading.Thread] = []
        start: Optional[float] = None
        for _ in range(streams):
            conn, _ = server.accept()
            start = start or time.monotonic()
            threads.append(threading.Thread(target=drain, args=(conn, start)))
            threads[-1].start()
        for thread in threads:
            thread.join()
    seconds = (max(lasts) - min(firsts)) if lasts else 0.0
    return {"gbit": counted[0] * 8 / seconds / 1e9 if seconds > 0 else 0.0, "streams": streams}


def _connect(host: str, port: int) -> socket.socket:
    deadline = time.monotonic() + 10  # until the receiver listens
    while True:
        try:
            return socket.create_connection((host, port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def send(host: str, port: int, total: float, streams: int = 1) -> None:
    conns = [_connect(host, port) for _ in range(streams)]
    block = b"\0" * BLOCK
    end = time.monotonic() + total

    def push(conn: socket.socket) -> None:
        with conn:
            while time.monotonic() < end:
                conn.sendall(block)

    threads = [threading.Thread(target=push, args=(c,)) for c in conns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"] and len(args) in (3, 4):
        print(json.dumps(serve(int(args[1]), float(args[2]), int(args[3]) if len(args) > 3 else 1)))
        return 0
    if args[:1] == ["send"] and len(args) in (4, 5):
        send(args[1], int(args[2]), float(args[3]), int(args[4]) if len(args) > 4 else 1)
        return 0
    print(__doc__.splitlines()[-2].strip() + "\n" + __doc__.splitlines()[-1].strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
