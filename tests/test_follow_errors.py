"""Issue 19 §7: a connection lost while following a run (`fab logs --follow`, `fab train --follow`)
is one line, not a traceback. A real sshd behind a TCP relay the test cuts: paramiko sees what it
sees when a node's address goes away (a Spot interruption, a network drop)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time

import pytest
from conftest import REPO, one_node_inventory, tool_env
from one_sshd import needs_root_and_sshd, serve
from runfiles import full_status

from clusterops.inventory import write_known_hosts

pytestmark = needs_root_and_sshd


class Relay:
    """127.0.0.1:port -> target, until cut(): then every relayed connection is reset."""

    def __init__(self, target: int):
        self.target, self.socks, self.listener = target, [], socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self.socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def cut(self, wake: bool = False):
        """wake: also shut the sockets down, else a pump blocked in recv keeps its socket open in the kernel
        until the client sends again (a client waiting for a command's output would wait for ever)."""
        self.listener.close()
        for sock in self.socks:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            if wake:
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@pytest.fixture
def followed(tmp_path):
    """A running run on a 'node' (a real sshd) reached through a Relay; yields (inventory path, relay)."""
    with serve(tmp_path) as port:
        yield from _followed(tmp_path, port)


def _followed(tmp_path, port: int):
    relay = Relay(port)
    write_known_hosts(tmp_path / "known_hosts", ["127.0.0.1"], (tmp_path / "host.pub").read_text(), relay.port)
    run = tmp_path / "data" / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "run-status.json").write_text(json.dumps(full_status(state="running")))
    (run / "train.log").write_text("step 1 loss 2.0\n")
    yield one_node_inventory(tmp_path, "follow", relay.port, "client"), relay


def test_a_connection_lost_while_following_is_one_line(followed):
    path, relay = followed
    follower = subprocess.Popen(
        ["fab", "logs", "--run", "r1", "--follow"],
        cwd=REPO,
        env=tool_env(GPU_CLUSTER_INVENTORY=str(path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert follower.stdout.readline() == "step 1 loss 2.0\n"
    time.sleep(1.5)  # a poll or two on the open connection, then the address goes away
    relay.cut()
    _, err = follower.communicate(timeout=90)
    assert follower.returncode == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: lost the connection to node0 (127.0.0.1) while following"), (
        err
    )
    assert lines[0].endswith("the run goes on: `fab logs --follow` picks it up again (`fab status` first)"), err


THEN_STOP_REASON = "run ended at step 10; then-stop: stopping the cluster"
STOPPING_LINE = "the cluster is stopping (--then-stop): `fab start` brings it back"


def _final_status(path, then_stop: str, when: str = "t") -> None:
    """The supervisor's final status, written atomically as rundir.write_record does."""
    record = {"state": "finished", "exit_code": 0, "reason": THEN_STOP_REASON, "time": when, "head": "node0"}
    path.with_suffix(".tmp").write_text(json.dumps({**record, "then_stop": then_stop}))
    path.with_suffix(".tmp").rename(path)


def _follower(path):
    return subprocess.Popen(
        ["fab", "logs", "--run", "r1", "--follow"],
        cwd=REPO,
        env=tool_env(GPU_CLUSTER_INVENTORY=str(path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_connection_lost_after_a_then_stop_status_is_the_cluster_stopping(followed):
    """--then-stop (implied by --budget-usd) stops the head node right after the final status: the reads
    after it race the shutdown. Before: "lost the connection ... the run goes on", exit 1."""
    path, relay = followed
    run = path.parent / "data" / "runs" / "r1"
    os.mkfifo(run / "summary.json")  # the follower's read of it blocks: the node goes away right there
    follower = _follower(path)
    assert follower.stdout.readline() == "step 1 loss 2.0\n"
    _final_status(run / "run-status.json", "stopping")
    deadline = time.monotonic() + 30
    while True:  # a writer can open the FIFO only once the follower reads it, past the final status
        try:
            held = os.open(run / "summary.json", os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            assert time.monotonic() < deadline and follower.poll() is None
            time.sleep(0.05)
    relay.cut(wake=True)  # as the head node's shutdown ends its sshd in the middle of a read
    os.close(held)
    out, err = follower.communicate(timeout=90)
    assert follower.returncode == 0 and err == "", err  # the run finished; the stop is what it asked for
    assert out.splitlines()[-2:] == [f"run {run}: finished | ({THEN_STOP_REASON})", STOPPING_LINE], out


@pytest.mark.parametrize("outcome", ["sent", "failed"])
def test_a_follower_waits_for_then_stops_outcome_and_says_a_failure_loudly(followed, outcome):
    """Before: the follower ended at the first final status; the supervisor rewrote it to "... failed: the
    cluster keeps running" after the laptop had stopped following (exit 0, not a word of it)."""
    path, _ = followed
    run = path.parent / "data" / "runs" / "r1"
    follower = _follower(path)
    assert follower.stdout.readline() == "step 1 loss 2.0\n"
    _final_status(run / "run-status.json", "stopping")
    time.sleep(2.5)  # the stop request takes seconds (the watchdog's EC2 StopInstances)
    _final_status(run / "run-status.json", outcome)
    out, err = follower.communicate(timeout=60)
    if outcome == "sent":
        assert follower.returncode == 0 and err == "" and out.splitlines()[-1] == STOPPING_LINE, (out, err)
    else:
        assert follower.returncode == 1 and STOPPING_LINE not in out, out
        assert err.strip() == (
            "error: --then-stop failed: the cluster keeps running (on AWS, billed): the run's log says why "
            "(`fab logs`); `fab stop-cluster` stops it"
        ), err


def test_a_stopping_left_by_a_head_that_went_down_is_not_waited_for(followed):
    """The head went down before it could write `sent`; after `fab start` a follow re-attaches to that run.
    Before: it waited 330 s for an outcome nobody would write, then said the cluster is stopping."""
    path, _ = followed
    run = path.parent / "data" / "runs" / "r1"
    ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 600))
    _final_status(run / "run-status.json", "stopping", ended)
    started = time.monotonic()
    out, err = _follower(path).communicate(timeout=60)
    assert time.monotonic() - started < 20, "waited for a then-stop outcome that cannot come"
    assert out.splitlines()[-1] == (
        f"--then-stop was requested when the run ended ({ended}); `fab status` shows the cluster now"
    ), (out, err)
