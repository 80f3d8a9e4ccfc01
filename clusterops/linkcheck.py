"""The links for `fab check`: raw TCP throughput between every pair of nodes, both directions, in
rounds where each node sends one stream and receives one (iperf3, else a small Python socket test);
the all-reduce bus bandwidth as a share of the median pair; and the network NCCL chose on each node,
read from its NCCL_DEBUG=INFO lines."""

from __future__ import annotations

import json
import re
import shlex
import statistics
import time
from typing import Optional, Sequence

from .health import SLOW_LINK_SHARE

IPERF_PORT = 5201  # iperf3's own default
SOCKET_PORT = 5202
q = shlex.quote

# The fallback: a receiver that counts what arrives after `omit` seconds (TCP's ramp-up), and a
# sender that writes 1 MiB blocks for omit + seconds. The receiver's figure is the one reported.
SOCKET_SERVER = r"""
import json, socket, sys, time
port, omit = int(sys.argv[1]), float(sys.argv[2])
with socket.create_server(("0.0.0.0", port)) as server:
    server.settimeout(30)
    conn, _ = server.accept()
    start = time.monotonic(); counted = 0; first = None
    with conn:
        while True:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            now = time.monotonic()
            if now - start >= omit:
                first = first or now
                counted += len(chunk)
    seconds = time.monotonic() - (first or start)
print(json.dumps({"gbit": counted * 8 / seconds / 1e9 if seconds > 0 else 0.0}))
"""
SOCKET_CLIENT = r"""
import socket, sys, time
host, port, total = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + 10
while True:
    try:
        conn = socket.create_connection((host, port), timeout=5)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
block = b"\0" * (1 << 20)
end = time.monotonic() + total
with conn:
    while time.monotonic() < end:
        conn.sendall(block)
"""


def parse_iperf(output: str) -> float:
    """Gbit/s the receiver saw, from `iperf3 -J` output."""
    report = json.loads(output)
    if "error" in report:
        raise ValueError(f"iperf3: {report['error']}")
    return report["end"]["sum_received"]["bits_per_second"] / 1e9


def refused(iperf_json: str) -> bool:
    """iperf3 -J exits 0 even when it could not connect (3.12 on Debian 12): the JSON says so."""
    return "unable to connect" in iperf_json


def pair_rate(src, dst, dst_ip: str, seconds: int, tool: str, python: str) -> tuple[float, str]:
    """(Gbit/s from src to dst, the tool that measured it): Fabric connections, the server started on
    dst first. An iperf3 run that never connects falls back to the socket test for that pair."""
    if tool == "iperf3":
        server = dst.run(
            f"timeout {seconds + 30} iperf3 -s -1 -p {IPERF_PORT}", asynchronous=True, hide=True, warn=True
        )
        client = f"iperf3 -c {q(dst_ip)} -p {IPERF_PORT} -t {seconds} -O 1 -J"
        deadline = time.monotonic() + 20  # until the server listens (slow to start on a loaded machine)
        while time.monotonic() < deadline:
            result = src.run(client, hide=True, warn=True, in_stream=False)
            if result.exited == 0 and not refused(result.stdout):
                server.join()
                return parse_iperf(result.stdout), tool
            time.sleep(0.1)
        dst.run(f"pkill -f -- {q('[i]perf3 -s -1 -p ' + str(IPERF_PORT))} || true", hide=True, warn=True)
        server.join()
    serve = f"timeout {seconds + 30} {q(python)} -c {q(SOCKET_SERVER)} {SOCKET_PORT} 0.5"
    server = dst.run(serve, asynchronous=True, hide=True, warn=True)
    src.run(f"{q(python)} -c {q(SOCKET_CLIENT)} {q(dst_ip)} {SOCKET_PORT} {seconds + 0.5}", hide=True, in_stream=False)
    return json.loads(server.join().stdout.strip().splitlines()[-1])["gbit"], "python-socket"


def rounds(names: Sequence[str]) -> list[list[tuple[str, str]]]:
    """Every ordered pair once, in n-1 rounds: in round k node i sends to node i+k, so each node sends
    one stream and receives one at a time (full-duplex links: no stream shares a direction) and the
    matrix takes n-1 test times, not n(n-1) (32 nodes: 31 instead of 992)."""
    n = len(names)
    return [[(names[i], names[(i + k) % n]) for i in range(n)] for k in range(1, n)]


def matrix(connections: dict, addresses: dict[str, str], seconds: int, tool: str, python: str) -> list[dict]:
    """Every ordered pair of nodes, a round at a time (see rounds), in the nodes' order."""
    from concurrent.futures import ThreadPoolExecutor

    def rate(pair: tuple[str, str]) -> tuple[float, str]:
        src, dst = pair
        return pair_rate(connections[src], connections[dst], addresses[dst], seconds, tool, python)

    for connection in connections.values():
        connection.open()  # before the threads share them
    order = list(connections)
    pairs = []
    for batch in rounds(order):
        with ThreadPoolExecutor(len(batch)) as pool:
            for (src, dst), (gbit, used) in zip(batch, pool.map(rate, batch)):
                pairs.append({"src": src, "dst": dst, "gbit": round(gbit, 3), "tool": used})
    return sorted(pairs, key=lambda p: (order.index(p["src"]), order.index(p["dst"])))


def slow_pairs(pairs: Sequence[dict]) -> list[dict]:
    median = statistics.median(p["gbit"] for p in pairs) if pairs else 0.0
    return [p for p in pairs if p["gbit"] < SLOW_LINK_SHARE * median]


_BUSBW = re.compile(r"busbw ([\d.]+) Gbit/s")


def parse_busbw(output: str) -> Optional[float]:
    found = _BUSBW.findall(output)
    return float(found[-1]) if found else None


def summary(pairs: Sequence[dict], busbw: Optional[float], nodes: Sequence[str], tool: str) -> dict:
    """What link.json holds (`fab report` reads median_gbit and allreduce_busbw_gbit)."""
    median = round(statistics.median(p["gbit"] for p in pairs), 3) if pairs else None
    return {
        "median_gbit": median,
        "pairs": list(pairs),
        "slow_pairs": slow_pairs(pairs),
        "allreduce_busbw_gbit": busbw,
        "busbw_fraction": round(busbw / median, 3) if busbw and median else None,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nodes": list(nodes),
        "tool": "+".join(sorted({p.get("tool", tool) for p in pairs})) or tool,
    }


# NCCL_DEBUG=INFO lines are "HOST:PID:TID [DEV] NCCL INFO ..." (mpirun may prefix them). NCCL logs
# "Using network Socket|IB|<plugin>" once per communicator (src/init.cc); the aws-ofi-nccl plugin names
# itself "Libfabric" ("AWS Libfabric" before 2025; "OFI" when NCCL_NET=OFI asks for it) and logs
# "NET/OFI Selected provider is efa, fabric is ..." ("Selected Provider is efa (found N nics)" before
# 2025); channels say "via NET/<name>/...".
_NCCL_LINE = re.compile(r"([A-Za-z0-9][\w.-]*):\d+:\d+ \[\d+\] NCCL INFO (.*)")
_NETWORK = re.compile(r"^Using network (.+?)\s*$|via NET/([A-Za-z ]+?)/")
_PROVIDER = re.compile(r"NET/OFI Selected provider is (\w+)", re.IGNORECASE)


def parse_transport(log: str) -> dict[str, str]:
    """host -> the network NCCL chose there: "efa", "socket", "ib", or "libfabric (PROVIDER)"."""
    networks: dict[str, str] = {}
    providers: dict[str, str] = {}
    for line in log.splitlines():
        match = _NCCL_LINE.search(line)
        if not match:
            continue
        host, message = match.groups()
        chosen = _PROVIDER.search(message)
        if chosen:
            providers[host] = chosen.group(1).lower()
        named = _NETWORK.search(message)
        if named and host not in networks:
            networks[host] = (named.group(1) or named.group(2)).strip()
    found = {}
    for host, network in networks.items():
        if "libfabric" in network.lower() or network.lower() == "ofi":
            provider = providers.get(host, "unknown provider")
            found[host] = "efa" if provider == "efa" else f"libfabric ({provider})"
        else:
            found[host] = network.lower()
    return found


def allreduce(connection, inventory, nodes, interface: str, code_dir: str, mb: float, gpus: bool) -> str:
    """bench_allreduce.py across `nodes` from the head node; with GPUs, NCCL logs its choices."""
    from . import launch, remote

    # Not forced onto the plugin: the check sees which network NCCL picks on its own (fab train forces it).
    prefix = launch.mpirun_prefix(inventory, nodes, interface, allow_tcp=True)
    if gpus:
        prefix += ["-x", "NCCL_DEBUG=INFO", "-x", "NCCL_DEBUG_SUBSYS=INIT,NET"]
    argv = prefix + [inventory.python, f"{code_dir}/bench_allreduce.py", "--mb", str(mb)]
    result = connection.run("timeout 300 " + shlex.join(argv), hide=True, warn=True, in_stream=False)
    if result.exited != 0:
        raise remote.RemoteError(
            f"the all-reduce failed (exit {result.exited}): {remote._failure_line(result.stderr + result.stdout)}"
        )
    return result.stdout + result.stderr


def measure(inventory, nodes, interface: str, code_dir: str, seconds: int, mb: float, gpus: bool) -> tuple[dict, str]:
    """The pairwise matrix, then the all-reduce: (link.json's content, the all-reduce's output),
    link.json written on the head node's /data."""
    from . import remote

    connections = {node.name: remote.connect(inventory, node) for node in nodes}
    try:
        head = connections[nodes[0].name]
        found = remote.sh(head, "command -v iperf3 >/dev/null && echo yes || true").strip()
        everywhere = found and all(
            remote.sh(c, "command -v iperf3 >/dev/null && echo yes || true").strip() for c in connections.values()
        )
        tool = "iperf3" if everywhere else "python-socket"
        addresses = {node.name: node.private_ip for node in nodes}
        pairs = matrix(connections, addresses, seconds, tool, inventory.python)
        output = allreduce(head, inventory, nodes, interface, code_dir, mb, gpus)
        link = summary(pairs, parse_busbw(output), [n.name for n in nodes], tool)
        remote.sh(head, f"mkdir -p {q(inventory.data_dir + '/.cluster')}")
        remote.write_file(head, link_file(inventory), json.dumps(link, indent=2) + "\n")
        return link, output
    finally:
        for connection in connections.values():
            connection.close()


def link_file(inventory) -> str:
    return f"{inventory.data_dir}/.cluster/link.json"
