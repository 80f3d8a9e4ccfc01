"""The emulated cluster's network (localcluster.py): a bridge, per node a network namespace joined to it by
a veth pair, links capped with `tc tbf`; and taking them down again. Root only."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time


class LocalClusterError(RuntimeError):
    pass


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise LocalClusterError(f"`{shlex.join(args)}` failed: {result.stderr.strip() or result.stdout.strip()}")
    return result


def _in(netns: str | None) -> tuple[str, ...]:
    return ("ip", "netns", "exec", netns) if netns else ()


def cap(device: str, rate: str, netns: str | None = None) -> None:
    run(
        *_in(netns),
        "tc",
        "qdisc",
        "replace",
        "dev",
        device,
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        "256kb",
        "latency",
        "50ms",
    )


def cap_node(netns: str, veth: str, rate: str | None) -> None:
    """Cap both ends of a node's link at `rate`, or lift the cap (None)."""
    for device, where in ((veth, None), ("eth0", netns)):
        if rate:
            cap(device, rate, where)
        else:
            run(*_in(where), "tc", "qdisc", "del", "dev", device, "root", check=False)


def make_bridge(bridge: str, cidr: str) -> None:
    run("ip", "link", "add", bridge, "type", "bridge")
    run("ip", "addr", "add", cidr, "dev", bridge)
    run("ip", "link", "set", bridge, "up")


def make_node_network(netns: str, veth: str, bridge: str, cidr: str, link: str | None) -> None:
    """A namespace whose eth0 (at `cidr`) is a veth pair's end; the other end joins the bridge."""
    run("ip", "netns", "add", netns)
    run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
    run("ip", "link", "set", veth, "master", bridge, "up")
    run("ip", "-n", netns, "addr", "add", cidr, "dev", "eth0")
    run("ip", "-n", netns, "link", "set", "eth0", "up")
    run("ip", "-n", netns, "link", "set", "lo", "up")
    if link:
        cap_node(netns, veth, link)


def remove_node_network(netns: str, veth: str) -> bool:
    """Stop every process in the namespace, delete it and the veth; True when the namespace existed."""
    existed = run("ip", "netns", "pids", netns, check=False).returncode == 0
    if existed:
        kill_namespace(netns)
        run("ip", "netns", "delete", netns, check=False)
    run("ip", "link", "delete", veth, check=False)
    return existed


def remove_bridge(bridge: str) -> bool:
    if run("ip", "link", "show", bridge, check=False).returncode != 0:
        return False
    run("ip", "link", "delete", bridge)
    return True


def kill_namespace(netns: str) -> None:
    """SIGTERM, then SIGKILL, every process in the namespace, waiting up to 3 s for each."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in run("ip", "netns", "pids", netns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and run("ip", "netns", "pids", netns, check=False).stdout.split():
            time.sleep(0.05)
