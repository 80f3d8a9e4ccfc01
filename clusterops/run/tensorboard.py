"""TensorBoard on the head node, reached through an SSH tunnel (nothing opened to the network)."""

from __future__ import annotations

import shlex
import time

from fabric import Connection

from clusterops.inventory import Inventory
from clusterops.nodes import remote

q = shlex.quote


TENSORBOARD_PORT = 16006
LOCAL_PORT = 6006  # TensorBoard's own default, on the laptop's end of the tunnel


def stop_tensorboard(connection: Connection) -> bool:
    """End the head node's TensorBoard; True when one was running."""
    return (
        remote.sh(connection, "pkill -f -- '[t]ensorboard.main --logdir' && echo stopped || true").strip() == "stopped"
    )


def ensure_tensorboard(
    connection: Connection, inventory: Inventory, port: int = TENSORBOARD_PORT, wait: float = 120.0
) -> None:
    """TensorBoard over /data/runs on the head node's loopback only, started if needed; returns
    once it accepts connections (a tunnel opened earlier would forward into nothing)."""
    probe = f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo up || true"
    if remote.sh(connection, f"bash -c {q(probe)}").strip() == "up":
        return
    logdir = q(f"{inventory.data_dir}/runs")
    remote.sh(
        connection,
        f"setsid nohup {q(inventory.python)} -m tensorboard.main --logdir {logdir} "
        f"--host 127.0.0.1 --port {port} > /tmp/tensorboard.log 2>&1 < /dev/null &",
    )
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if remote.sh(connection, f"bash -c {q(probe)}").strip() == "up":
            return
        time.sleep(1.0)
    raise remote.RemoteError(
        f"TensorBoard did not start within {wait:.0f} s; see /tmp/tensorboard.log on the head node"
    )


# ---------------------------------------------------------------- check
