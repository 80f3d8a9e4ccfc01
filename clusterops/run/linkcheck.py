"""The links for `fab check`: raw TCP throughput between every pair of nodes, both directions, in
rounds where each node sends and receives one pair's traffic at a time, over as many TCP streams as
NCCL's socket transport opens on that NIC (iperf3 -P, else a small Python socket test); the all-reduce
bus bandwidth as a share of the median pair (on EFA, the link itself); and the network NCCL chose on
each node, read from its NCCL_DEBUG=INFO lines."""

from __future__ import annotations

import json
import re
import shlex
import statistics
import time
from typing import Optional, Sequence

from cluster_node.programs.health import SLOW_LINK_SHARE
from cluster_node.protocol import clusterdir
from clusterops.nodes.command import node_command
from clusterops.run import lifecycle

IPERF_PORT = 5201  # iperf3's own default
SOCKET_PORT = 5202
q = shlex.quote

# NCCL's socket transport (src/transport/net_socket.cc, ncclSocketGetNsockNthread): NCCL_SOCKET_NTHREADS
# x NCCL_NSOCKS_PERTHREAD connections per peer; unset, 2 x 8 on AWS's ENA (PCI vendor 0x1d0f), else 1 x 1;
# at most 16 threads and 64 sockets. One TCP flow is capped at 5 Gbit/s by EC2 (10 in a cluster
# placement group): the link is what that many streams carry.
AWS_VENDOR = "0x1d0f"
MAX_THREADS, MAX_SOCKETS = 16, 64


def nccl_streams(vendor: Optional[str], environ: dict) -> int:
    """How many TCP connections NCCL's socket transport opens to a peer on a NIC of this PCI vendor."""
    auto_threads, auto_socks = (2, 8) if (vendor or "").strip().lower() == AWS_VENDOR else (1, 1)
    threads = min(int(environ.get("NCCL_SOCKET_NTHREADS", auto_threads)), MAX_THREADS)
    socks = int(environ.get("NCCL_NSOCKS_PERTHREAD", auto_socks))
    if threads * socks > MAX_SOCKETS:
        socks = MAX_SOCKETS // threads
    return max(1, threads * socks)


def parse_iperf(output: str) -> float:
    """Gbit/s the receiver saw, from `iperf3 -J` output."""
    report = json.loads(output)
    if "error" in report:
        raise ValueError(f"iperf3: {report['error']}")
    return report["end"]["sum_received"]["bits_per_second"] / 1e9


def iperf_streams(output: str) -> int:
    """How many parallel streams an `iperf3 -J` run used."""
    return len(json.loads(output)["end"].get("streams", [])) or 1


def refused(iperf_json: str) -> bool:
    """iperf3 -J exits 0 even when it could not connect (3.12 on Debian 12): the JSON says so."""
    return "unable to connect" in iperf_json


def pair_rate(src, dst, dst_ip: str, seconds: int, tool: str, inventory, streams: int = 1) -> tuple[float, str, int]:
    """(Gbit/s from src to dst over `streams` TCP streams, the tool that measured it, the streams it
    used): Fabric connections, the server started on dst first. An iperf3 run that never connects
    falls back to the socket test for that pair (cluster_node.programs.linktest)."""
    if tool == "iperf3":
        server = dst.run(
            f"timeout {seconds + 30} iperf3 -s -1 -p {IPERF_PORT}", asynchronous=True, hide=True, warn=True
        )
        client = f"iperf3 -c {q(dst_ip)} -p {IPERF_PORT} -t {seconds} -O 1 -P {streams} -J"
        deadline = time.monotonic() + 20  # until the server listens (slow to start on a loaded machine)
        while time.monotonic() < deadline:
            result = src.run(client, hide=True, warn=True, in_stream=False)
            if result.exited == 0 and not refused(result.stdout):
                server.join()
                return parse_iperf(result.stdout), tool, iperf_streams(result.stdout)
            time.sleep(0.1)
        dst.run(f"pkill -f -- {q('[i]perf3 -s -1 -p ' + str(IPERF_PORT))} || true", hide=True, warn=True)
        server.join()
    serve = node_command(inventory, "programs.linktest", "serve", SOCKET_PORT, 0.5, streams, timeout=seconds + 30)
    server = dst.run(serve, asynchronous=True, hide=True, warn=True)
    client = node_command(inventory, "programs.linktest", "send", dst_ip, SOCKET_PORT, seconds + 0.5, streams)
    src.run(client, hide=True, in_stream=False)
    found = json.loads(server.join().stdout.strip().splitlines()[-1])
    return found["gbit"], "python-socket", found["streams"]


def rounds(names: Sequence[str]) -> list[list[tuple[str, str]]]:
    """Every ordered pair once, in n-1 rounds: in round k node i sends to node i+k, so each node sends
    one stream and receives one at a time (full-duplex links: no stream shares a direction) and the
    matrix takes n-1 test times, not n(n-1) (32 nodes: 31 instead of 992)."""
    n = len(names)
    return [[(names[i], names[(i + k) % n]) for i in range(n)] for k in range(1, n)]


def matrix(
    connections: dict, addresses: dict[str, str], seconds: int, tool: str, inventory, streams: int = 1
) -> list[dict]:
    """Every ordered pair of nodes over `streams` TCP streams, a round at a time (see rounds), in the
    nodes' order."""
    from concurrent.futures import ThreadPoolExecutor

    def rate(pair: tuple[str, str]) -> tuple[float, str, int]:
        src, dst = pair
        return pair_rate(connections[src], connections[dst], addresses[dst], seconds, tool, inventory, streams)

    for connection in connections.values():
        connection.open()  # before the threads share them
    order = list(connections)
    pairs = []
    for batch in rounds(order):
        with ThreadPoolExecutor(len(batch)) as pool:
            for (src, dst), (gbit, used, opened) in zip(batch, pool.map(rate, batch)):
                pairs.append({"src": src, "dst": dst, "gbit": round(gbit, 3), "tool": used, "streams": opened})
    return sorted(pairs, key=lambda p: (order.index(p["src"]), order.index(p["dst"])))


def slow_pairs(pairs: Sequence[dict]) -> list[dict]:
    median = statistics.median(p["gbit"] for p in pairs) if pairs else 0.0
    return [p for p in pairs if p["gbit"] < SLOW_LINK_SHARE * median]


_BUSBW = re.compile(r"busbw ([\d.]+) Gbit/s")


def parse_busbw(output: str) -> Optional[float]:
    found = _BUSBW.findall(output)
    return float(found[-1]) if found else None


_PEAK = re.compile(r"^matmul peak: ([\d.e+-]+) TFLOP/s (\w+), the slowest of \d+ rank\(s\) \((.+?); ", re.M)


def parse_peak(output: str) -> Optional[dict]:
    """train.bench_allreduce's `matmul peak:` line: what the slowest device reached, for `fab report`'s MFU."""
    found = _PEAK.findall(output)
    if not found:
        return None
    tflops, dtype, device = found[-1]
    return {"measured_tflops": float(tflops), "dtype": dtype, "device": device}


def summary(pairs: Sequence[dict], busbw: Optional[float], nodes: Sequence[str], tool: str, efa: bool = False) -> dict:
    """What link.json holds (`fab report` and `fab monitor` read link_gbit): the link is the median
    pair's TCP rate over NCCL's stream count, or on EFA (NCCL's traffic is not TCP) the all-reduce bus
    bandwidth."""
    median = round(statistics.median(p["gbit"] for p in pairs), 3) if pairs else None
    streams = max((p.get("streams", 1) for p in pairs), default=None)
    link, source = (busbw, "EFA: the all-reduce bus bandwidth") if efa else (median, f"TCP, {streams} stream(s)")
    return {
        "link_gbit": link,
        "link_source": source,
        "streams": streams,
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
    """train.bench_allreduce across `nodes` from the head node; with GPUs, NCCL logs its choices. On an
    EFA cluster first as `fab train` runs it, the OFI plugin required (NCCL_NET=OFI): if that fails
    (the plugin did not load), again as NCCL would choose on its own, so the verdict names what it
    fell back to and `fab train` refuses it."""
    from clusterops.nodes import remote

    efa = bool(inventory.extra.get("efa_cards"))
    try:
        return _allreduce(connection, inventory, nodes, interface, code_dir, mb, gpus, allow_tcp=not efa)
    except remote.RemoteError:
        if not efa:
            raise
        return _allreduce(connection, inventory, nodes, interface, code_dir, mb, gpus, allow_tcp=True)


def _allreduce(
    connection, inventory, nodes, interface: str, code_dir: str, mb: float, gpus: bool, allow_tcp: bool
) -> str:
    from clusterops.nodes import remote
    from clusterops.run import launch

    prefix = launch.mpirun_prefix(inventory, nodes, interface, allow_tcp=allow_tcp)
    if gpus:
        prefix += ["-x", "NCCL_DEBUG=INFO", "-x", "NCCL_DEBUG_SUBSYS=INIT,NET"]
    argv = prefix + [*launch.rank_program(inventory, code_dir, "bench_allreduce"), "--mb", str(mb)]
    result = connection.run("timeout 300 " + shlex.join(argv), hide=True, warn=True, in_stream=False)
    if result.exited != 0:
        raise remote.RemoteError(
            f"the all-reduce failed (exit {result.exited}): {lifecycle._failure_line(result.stderr + result.stdout)}"
        )
    return result.stdout + result.stderr


def stream_count(connection, interface: str, streams: Optional[int]) -> int:
    """`streams` if given, else what NCCL opens on the head node's `interface` (its PCI vendor)."""
    from clusterops.nodes import remote

    if streams:
        return streams
    vendor = remote.sh(connection, f"cat /sys/class/net/{q(interface)}/device/vendor 2>/dev/null || true")
    return nccl_streams(vendor.strip() or None, {})


def measure(
    inventory, nodes, interface: str, code_dir: str, seconds: int, mb: float, gpus: bool, streams: Optional[int] = None
) -> tuple[dict, str]:
    """The pairwise matrix, then the all-reduce: (link.json's content, the all-reduce's output),
    link.json written on the head node's /data."""
    from clusterops.nodes import remote

    connections = {node.name: remote.connect(inventory, node) for node in nodes}
    try:
        head = connections[nodes[0].name]
        found = remote.sh(head, "command -v iperf3 >/dev/null && echo yes || true").strip()
        everywhere = found and all(
            remote.sh(c, "command -v iperf3 >/dev/null && echo yes || true").strip() for c in connections.values()
        )
        tool = "iperf3" if everywhere else "python-socket"
        addresses = {node.name: node.private_ip for node in nodes}
        count = stream_count(head, interface, streams)
        pairs = matrix(connections, addresses, seconds, tool, inventory, count)
        output = allreduce(head, inventory, nodes, interface, code_dir, mb, gpus)
        efa = bool(inventory.extra.get("efa_cards"))
        link = {**summary(pairs, parse_busbw(output), [n.name for n in nodes], tool, efa=efa)}
        link["matmul_peak"] = parse_peak(output)
        remote.sh(head, f"mkdir -p {q(inventory.data_dir + '/.cluster')}")
        remote.write_file(head, link_file(inventory), json.dumps(link, indent=2) + "\n")
        return link, output
    finally:
        for connection in connections.values():
            connection.close()


def link_file(inventory) -> str:
    return f"{inventory.data_dir}/{clusterdir.CLUSTER}/{clusterdir.LINK_JSON}"
