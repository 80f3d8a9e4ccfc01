"""`fab local.up --repair`: bring a dead emulated node back without touching /data (issue 23 §4).

A node whose entrypoint died (or whose namespace was deleted) is restarted the way `up` started it,
with the same address, CPU slice, link cap and the cluster's SSH identity from /data, so the
inventory, known_hosts and every run on /data stay as they were.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from cluster_node.protocol import clusterdir
from cluster_node.protocol.contract import CONTAINER_SSH_PORT
from clusterops.local import cluster as lc
from clusterops.local import net as localnet


def repair(name: str, inventory_path: Path) -> list[str]:
    """Restart the nodes whose sshd no longer answers (a crashed entrypoint, a deleted namespace),
    keeping /data and the cluster's identity: `fab local.up --repair`. Returns the nodes restarted."""
    lc.preflight()
    record_path = lc.STATE_ROOT / name / "cluster.json"
    if not record_path.exists():
        raise lc.LocalClusterError(f"no local cluster named {name!r} is up: `fab local.up` starts one")
    record = json.loads(record_path.read_text())
    spec = lc.LocalSpec(**record["spec"])
    shared, controller = spec.state_dir / "shared", spec.state_dir / "controller"
    restarted = []
    for rank in range(spec.nodes):
        if _answers(spec.node_ip(rank)):
            continue
        netns = spec.netns(rank)
        veth, cidr = spec.host_veth(rank), f"{spec.node_ip(rank)}/{spec.prefix}"
        if localnet.run("ip", "netns", "pids", netns, check=False).returncode == 0:
            localnet.kill_namespace(netns)  # what is left of the dead node (its mounts go with its processes)
        else:
            localnet.run("ip", "link", "delete", veth, check=False)
            localnet.make_node_network(netns, veth, spec.bridge, cidr, spec.link)
        record["pids"][str(rank)] = lc._start_node(spec, rank, shared, controller, {})
        lc._save_record(spec, record)
        restarted.append(f"node{rank}")
    lc._wait_ready(spec, shared)
    lc._write_inventory(spec, shared / clusterdir.CLUSTER / clusterdir.SSH_DIR, controller, inventory_path)
    return restarted


def _answers(ip: str) -> bool:
    try:
        with socket.create_connection((ip, CONTAINER_SSH_PORT), timeout=1):
            return True
    except OSError:
        return False
