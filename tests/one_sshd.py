"""One real sshd on 127.0.0.1 in its own mount namespace (a private /run for /run/sshd, the host's ~/.bashrc
out of the way), the tests' stand-in for a node that fab reaches over SSH: keys and config in a directory,
`serve` runs it for a `with` block. Needs root and sshd (`needs_root_and_sshd`)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

needs_root_and_sshd = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("sshd"), reason="runs sshd in its own mount namespace: needs root"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sshd_config(tmp: Path, port: int) -> Path:
    """Host and client keys (tmp/host, tmp/client), the client's key authorized, the image's sshd settings."""
    for key in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / key)], check=True)
    shutil.copy(tmp / "client.pub", tmp / "authorized_keys")
    config = tmp / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp / 'host'}\nAuthorizedKeysFile {tmp / 'authorized_keys'}\n"
        f"PidFile {tmp / 'sshd.pid'}\nStrictModes no\nUsePAM no\nUseDNS no\nPasswordAuthentication no\n"
        "PermitRootLogin prohibit-password\nMaxStartups 64:30:128\nSubsystem sftp internal-sftp\n"  # as the image's
    )
    return config


@contextmanager
def serve(tmp: Path) -> Iterator[int]:
    """sshd configured in `tmp` (sshd_config), listening until the block ends; yields its port."""
    port = free_port()
    config = sshd_config(tmp, port)
    (tmp / "bashrc").write_text("")
    script = (
        "mount -t tmpfs tmpfs /run && mkdir /run/sshd && "
        f"{{ [ ! -f ~/.bashrc ] || mount --bind {tmp / 'bashrc'} ~/.bashrc; }} && "
        f"exec {shutil.which('sshd')} -D -e -f {config}"
    )
    with open(tmp / "sshd.log", "w") as log:
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
        sshd = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + 10
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert time.monotonic() < deadline and sshd.poll() is None, (tmp / "sshd.log").read_text()
            time.sleep(0.05)
        yield port
    finally:
        sshd.terminate()
        sshd.wait(timeout=10)
