"""Node observation over SSH: the interface holding a node's address, `fab status`'s row, `fab monitor`'s
sample. Each sends one line (`python -m cluster_node.X`) and parses its JSON."""

from __future__ import annotations

import json
import re
import shlex
from typing import Optional

from fabric import Connection

from clusterops import terminal
from clusterops.inventory import Inventory, Node
from clusterops.nodes import command as nodecmd
from clusterops.nodes import remote

q = shlex.quote
_IFACE = re.compile(r"^\d+:\s+(\S+)\s+inet\s+(\d+\.\d+\.\d+\.\d+)/\d+")


def detect_interface(connection: Connection, node: Node) -> str:
    return parse_interface(remote.sh(connection, "ip -o -4 addr show"), node.private_ip)


def parse_interface(ip_addr_output: str, address: str) -> str:
    """The interface holding `address`, from `ip -o -4 addr show` output."""
    for line in ip_addr_output.splitlines():
        match = _IFACE.match(line.strip())
        if match and match.group(2) == address:
            return match.group(1)
    stale = "is the inventory stale? (`fab inventory` or `fab local.up`)"
    raise remote.RemoteError(f"no interface holds {address}: {stale}")


# ---------------------------------------------------------------- status


def node_status(connection: Connection, inventory: Inventory, node: Node) -> dict:
    command = nodecmd.node_command(inventory, "programs.node_status", "--data", inventory.data_dir, "--name", node.name)
    found = json.loads(remote.sh(connection, command).strip().splitlines()[-1])
    return {**terminal.status_row(found), "deploy_timeline": found.get("deploy")}


SAMPLE_SECONDS = 2  # fab monitor's default sample


def sample_node(
    connection: Connection, inventory: Inventory, node: Node, interval: float, link_gbit: Optional[float] = None
) -> dict:
    """One node over `interval` seconds: CPU cores its processes used, GPU utilisation, and network
    rx/tx on the cluster interface in Mbit/s and as a share of the measured link (when known)."""
    iface = detect_interface(connection, node)
    out = remote.sh(connection, nodecmd.node_command(inventory, "programs.sample", iface, float(interval))).split()
    rx, tx, seconds = int(out[0]), int(out[1]), float(out[2])
    rx_mbit, tx_mbit = rx * 8 / seconds / 1e6, tx * 8 / seconds / 1e6
    share = lambda mbit: f"{mbit / (link_gbit * 1000):.0%}" if link_gbit else "n/a"
    return {
        "cpu": f"{out[3]}/{out[4]} cores",
        "gpu_util": out[5],
        "rx_mbit": f"{rx_mbit:.1f}",
        "tx_mbit": f"{tx_mbit:.1f}",
        "rx_link": share(rx_mbit),
        "tx_link": share(tx_mbit),
    }
