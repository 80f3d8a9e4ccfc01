"""Issue 19 §7: a connection lost while following a run (`fab logs --follow`, `fab train --follow`)
is one line, not a traceback. A real sshd behind a TCP relay the test cuts: paramiko sees what it
sees when a node's address goes away (a Spot interruption, a network drop)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time

import pytest
from conftest import REPO, one_node_inventory, tool_env
from test_fanout import _free_port, _sshd_config, pytestmark  # noqa: F401 - same needs: root and sshd

from clusterops.inventory import write_known_hosts


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

    def cut(self):
        self.listener.close()
        for sock in self.socks:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()


@pytest.fixture
def followed(tmp_path):
    """A running run on a 'node' (a real sshd) reached through a Relay; yields (inventory path, relay)."""
    port = _free_port()
    config = _sshd_config(tmp_path, port)
    (tmp_path / "bashrc").write_text("")
    script = (
        "mount -t tmpfs tmpfs /run && mkdir /run/sshd && "
        f"{{ [ ! -f ~/.bashrc ] || mount --bind {tmp_path / 'bashrc'} ~/.bashrc; }} && "
        f"exec {shutil.which('sshd')} -D -e -f {config}"
    )
    sshd = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
        assert time.monotonic() < deadline and sshd.poll() is None
        time.sleep(0.05)
    relay = Relay(port)
    write_known_hosts(tmp_path / "known_hosts", ["127.0.0.1"], (tmp_path / "host.pub").read_text(), relay.port)
    run = tmp_path / "data" / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "run-status.json").write_text(json.dumps({"state": "running"}))
    (run / "train.log").write_text("step 1 loss 2.0\n")
    yield one_node_inventory(tmp_path, "follow", relay.port, "client"), relay
    sshd.terminate()
    sshd.wait(timeout=10)


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
