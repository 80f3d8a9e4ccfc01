"""A node that does not answer may have a new address: EC2 gives an instance a new public IPv4
address every time it starts again (EC2 User Guide, "Public IPv4 addresses"), so a Spot node
restarted after an interruption, or one started from the console, is no longer where the
inventory says. "Answers" means: the sshd there shows the cluster's pinned host key (an address
EC2 handed to someone else may well run an sshd too)."""

from __future__ import annotations

import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Callable

import paramiko

from clusterops.inventory import Inventory, describe, write_known_hosts

# paramiko's transport thread logs a failed handshake with a traceback; a probe's failure is an answer.
_QUIET = logging.getLogger("gpu-cluster.probe")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


def pinned_host_key(inventory: Inventory) -> str:
    """The cluster's host key ("TYPE BASE64") from the inventory's known_hosts."""
    first = Path(inventory.ssh.known_hosts).read_text().split("\n", 1)[0]
    return " ".join(first.split()[1:3])


def shows_host_key(host: str, port: int, host_key: str, timeout: float = 5.0) -> bool:
    """Whether the sshd at host:port presents this host key (an SSH key exchange, no login)."""
    transport = None
    try:
        transport = paramiko.Transport(socket.create_connection((host, port), timeout=timeout))
        transport.logger = _QUIET
        transport.banner_timeout = transport.handshake_timeout = timeout
        transport.start_client(timeout=timeout)
        key = transport.get_remote_server_key()
        return f"{key.get_name()} {key.get_base64()}" == host_key
    except (OSError, EOFError, paramiko.SSHException):
        return False
    finally:
        if transport is not None:
            transport.close()


def readdress_unreachable(
    inventory: Inventory, ec2, reachable: Callable[[str, int], bool] | None = None
) -> tuple[Inventory, list[str]]:
    """The nodes that do not answer are looked up in EC2 and given their current public IP, the
    host key re-pinned there. Returns the inventory and a line per node that moved or is not
    running. Session Manager inventories address nodes by instance id: unchanged."""
    if inventory.source != "aws" or inventory.ssh.proxy_command:
        return inventory, []
    host_key = pinned_host_key(inventory)
    probe = reachable or (lambda host, port: shows_host_key(host, port, host_key))
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(inventory.nodes)))) as pool:
        up = list(pool.map(lambda n: probe(n.public_ip, inventory.ssh.port), inventory.nodes))
    silent = [n for n, ok in zip(inventory.nodes, up) if not ok and n.instance_id]
    if not silent:
        return inventory, []
    described = describe(ec2, [n.instance_id for n in silent if n.instance_id])
    moved, lines = {}, []
    for node in silent:
        instance = described.get(node.instance_id or "", {})
        state, public = instance.get("State", {}).get("Name", "terminated"), instance.get("PublicIpAddress")
        if public and public != node.public_ip:
            moved[node.rank] = replace(
                node, public_ip=public, private_ip=instance.get("PrivateIpAddress") or node.private_ip
            )
            lines.append(
                f"{node.name}: {node.public_ip} -> {public} (EC2 gave it a new public IP when it started again)"
            )
        elif state != "running":
            lines.append(
                f"{node.name} ({node.instance_id}) is {state}" + (": `fab start`" if state == "stopped" else "")
            )
    if not moved:
        return inventory, lines
    nodes = [moved.get(n.rank, n) for n in inventory.nodes]
    write_known_hosts(Path(inventory.ssh.known_hosts), [n.public_ip for n in nodes], host_key, port=inventory.ssh.port)
    return replace(inventory, nodes=nodes), lines
