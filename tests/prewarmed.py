"""A pre-imported interpreter for the tests' trainer runs.

Every trainer process spends ~3 s of CPU importing torch and torch._dynamo (torch's optimizer constructor
imports it) before its first step: a third of `make test`'s CPU on the 2-core machine, in tests that
check what the trainer computes (losses, checkpoints, resumes), not how it starts. So `test_training.train`
starts the trainer here: a server per test process imports torch once, then forks a child per run that
becomes `python -m train.train ARGS` as the interpreter would make it: its own sys.argv, environment,
working directory, stdio (the caller's pipes, passed over a Unix socket), sys.path[0], random seed and
exit status, with the trainer's own modules imported afresh in the child (the server imports none). Two
ranks get the torchrun variables the trainer and env:// read (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT), write-through stdout (torchrun's -u), each rank its own server (its own hash seed), and a
failed rank ends the others with status 1, as torchrun does.

What keeps real launches: the emulated cluster (mpirun over ssh), the tests that run torchrun itself
(test_training.TORCHRUN) or their own command line, and every run when GPU_CLUSTER_TEST_PREWARM=0.
What a child inherits that a fresh interpreter would not have: its server's string hash seed (shared by
the runs of one rank), warnings torch printed at import (on the server's stderr, not the child's), the
temporary directory tempfile chose then, and multiprocessing's authkey.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

ENABLE = "GPU_CLUSTER_TEST_PREWARM"
# What an interpreter reads at start-up or torch at import: a server serves only requests that agree.
IMPORT_TIME_PREFIXES = ("PYTHON", "TORCH", "OMP_", "MKL_", "KMP_", "CUDA", "LD_")
SET_BY_TORCH = {"TORCHINDUCTOR_CACHE_DIR"}  # set by importing torch._dynamo: in a test process that did, or not
HEADER = struct.Struct("!I")
FAILED_GRACE_S = 10  # a failed rank's siblings: SIGTERM, then SIGKILL after this


def enabled() -> bool:
    return os.environ.get(ENABLE, "1") != "0"


# ---------------------------------------------------------------- the server (its own process)


def serve(path: str) -> dict:
    """Import torch, listen on `path`, fork a child per request; returns only in a child, its request."""
    import torch  # noqa: F401 (the point: imported once, before the forks)
    import torch._dynamo  # noqa: F401 (what torch.optim's first call imports)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(32)
    print("ready", flush=True)
    parent, children = os.getppid(), {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while os.getppid() == parent:  # the test process gone: so is its server
        for key, _ in selector.select(timeout=0.2):
            if key.fileobj is listener:
                try:
                    request = _accept(listener, selector, children)
                except (OSError, ValueError) as error:  # that request fails (its caller sees the connection
                    print(f"prewarmed: {error!r}", file=sys.stderr)  # close), the server goes on
                    continue
                if request is not None:
                    return request
            else:
                _client_gone(key, selector, children)
        _reap(children, selector)
    for pid in children:
        _kill(pid, signal.SIGKILL)
    raise SystemExit(0)


def _accept(listener, selector, children: dict) -> dict | None:
    conn, _ = listener.accept()
    try:
        request, fds = _receive(conn)
        pid = os.fork()
    except BaseException:
        conn.close()
        raise
    if pid == 0:
        selector.close()
        listener.close()
        for other in children.values():
            other.close()
        conn.close()
        request["fds"] = fds
        return request
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    children[pid] = conn
    selector.register(conn, selectors.EVENT_READ, pid)
    return None


def _client_gone(key, selector, children: dict) -> None:
    """The caller closed its end (its timeout, or it died): its child is killed, not left running."""
    try:
        gone = not key.fileobj.recv(1)
    except OSError:
        gone = True
    if gone:
        selector.unregister(key.fileobj)
        _kill(key.data, signal.SIGKILL)


def _reap(children: dict, selector) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = children.pop(pid)
        try:
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            selector.unregister(conn)
        except (OSError, KeyError):  # the caller went first
            pass
        conn.close()


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ValueError("a request ended early")
        data += chunk
    return json.loads(data[HEADER.size :]), list(fds)


def become(request: dict) -> None:
    """In the forked child: the interpreter `python -m MODULE ARGS` or `python SCRIPT ARGS` would have
    been, then run it."""
    import random
    import runpy

    import numpy

    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # a fresh interpreter's, not the server's
    numpy.random.seed()
    if "RANK" in request["env"]:  # torchrun starts its ranks with -u
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    if request.get("module"):
        sys.path[0] = os.getcwd()  # what -m puts first
        sys.argv = ["-m", *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(request["path"]))  # what a script's run puts first
        sys.argv = [request["path"], *request["args"]]
        runpy.run_path(request["path"], run_name="__main__")


# ---------------------------------------------------------------- the caller's side


class Server:
    """One pre-imported server, started on first use and ended with this process."""

    def __init__(self, env: dict):
        self.path = os.path.join(tempfile.mkdtemp(prefix="prewarmed-"), "socket")
        self.process = subprocess.Popen(
            [sys.executable, __file__, self.path],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self.process.stdout.readline() if self.process.stdout else ""
        assert ready == "ready\n", f"the pre-imported server did not start (it said {ready!r})"
        atexit.register(shutil.rmtree, os.path.dirname(self.path), ignore_errors=True)  # after the kill: LIFO
        atexit.register(self.process.kill)

    def start(self, program: dict, env: dict, cwd: str, fds: list[int]) -> tuple[socket.socket, int]:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        body = json.dumps({**program, "env": env, "cwd": cwd}).encode()
        socket.send_fds(conn, [HEADER.pack(len(body)) + body], fds)
        return conn, int(_line(conn))


_servers: dict[tuple, Server] = {}


def _server(env: dict, rank: int) -> Server:
    """The server for this environment's import-time variables and this rank (ranks from different
    servers get different string hash seeds, as separate interpreters do); a dead one is replaced."""
    key = (
        rank,
        *sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in SET_BY_TORCH),
    )
    if key not in _servers or _servers[key].process.poll() is not None:
        _servers[key] = Server(env)
    return _servers[key]


def _line(conn: socket.socket) -> str:
    """One line, read a byte at a time: the pid's line never takes the exit status's with it."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            raise ConnectionError("the pre-imported server closed the connection")
        data += chunk
    return data.decode().strip()


def run(cmd: list[str], *, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env), with `python -m
    MODULE ARGS`, `python SCRIPT.py ARGS` and torchrun --standalone --nproc-per-node N over either forked
    from the pre-imported server; any other command (or GPU_CLUSTER_TEST_PREWARM=0) runs for real."""
    parsed = _program(cmd)
    if parsed is None or not enabled():
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    ranks, program = parsed
    if ranks > 1:
        port = _free_port()
        envs = [dict(env, **_torchrun_env(rank, ranks, port)) for rank in range(ranks)]
    else:
        envs = [env]
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        started = [
            _server(e, rank).start(program, e, os.getcwd(), [null, out_write, err_write]) for rank, e in enumerate(envs)
        ]
    finally:
        for fd in (null, out_write, err_write):
            os.close(fd)
    out, err, codes = _collect(started, out_read, err_read, timeout, cmd)
    failed = next((c for c in codes if c != 0), 0)  # the first rank to fail
    return subprocess.CompletedProcess(cmd, (1 if failed else 0) if ranks > 1 else failed, out, err)  # torchrun: 1


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]


def _program(cmd: list[str]) -> tuple[int, dict] | None:
    """(ranks, what the child runs) for the command lines served here; None for any other."""
    ranks, rest = 1, list(cmd)
    if rest[: len(TORCHRUN)] == TORCHRUN:
        ranks, rest = int(rest[len(TORCHRUN)]), [sys.executable, *rest[len(TORCHRUN) + 1 :]]
    if rest[:1] != [sys.executable] or len(rest) < 2:
        return None
    if rest[1] == "-m" and len(rest) > 2:
        return ranks, {"module": rest[2], "args": rest[3:]}
    if rest[1].endswith(".py"):
        return ranks, {"path": rest[1], "args": rest[2:]}
    return None


def _torchrun_env(rank: int, ranks: int, port: int) -> dict:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _collect(started, out_read: int, err_read: int, timeout: float, cmd: list[str]):
    """Read both pipes to their end and every rank's exit status; a failed rank ends the others."""
    selector = selectors.DefaultSelector()
    chunks: dict[int, list[bytes]] = {out_read: [], err_read: []}
    for fd in chunks:
        selector.register(fd, selectors.EVENT_READ)
    codes: dict[int, int] = {}
    for index, (conn, _) in enumerate(started):
        selector.register(conn, selectors.EVENT_READ, index)
    deadline, failed_at = time.monotonic() + timeout, None
    try:
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                _end(started, codes, signal.SIGKILL)
                raise subprocess.TimeoutExpired(cmd, timeout, b"".join(chunks[out_read]), b"".join(chunks[err_read]))
            for key, _ in selector.select(timeout=min(left, 1.0)):
                _read(key, selector, chunks, codes)
            if any(codes.values()):  # torchrun's way: the others are terminated, then killed
                failed_at = failed_at or time.monotonic()
                _end(
                    started, codes, signal.SIGTERM if time.monotonic() - failed_at < FAILED_GRACE_S else signal.SIGKILL
                )
    finally:
        for fd in chunks:
            os.close(fd)
        for conn, _ in started:
            conn.close()
    decode = lambda fd: b"".join(chunks[fd]).decode(errors="replace")  # noqa: E731
    return decode(out_read), decode(err_read), list(codes.values())  # in the order the ranks ended


def _read(key, selector, chunks: dict, codes: dict) -> None:
    if isinstance(key.fileobj, int):
        data = os.read(key.fileobj, 1 << 16)
        if data:
            chunks[key.fileobj].append(data)
        else:
            selector.unregister(key.fileobj)
    else:
        codes[key.data] = int(_line(key.fileobj))
        selector.unregister(key.fileobj)


def _end(started, codes: dict, sig: int) -> None:
    for index, (_, pid) in enumerate(started):
        if index not in codes:
            _kill(pid, sig)


if __name__ == "__main__":
    become(serve(sys.argv[1]))
