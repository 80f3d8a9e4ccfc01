"""The link check's parts: NCCL transport from real NCCL_DEBUG=INFO excerpts, iperf3's JSON and the socket
fallback measured on this machine's loopback, link.json's summary, and `fab train --exclude` input."""

import json
import re
import shutil
import subprocess
import sys
import time

import pytest
from conftest import REPO, _free_port, run_fab
from test_launch import inventory

from clusterops.inventory import InventoryError
from clusterops.run import linkcheck

# NVIDIA/nccl issue #1053: NCCL on its own socket transport.
SOCKET_LOG = """\
axa:3048391:3048566 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to lo
axa:3048391:3048566 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>
axa:3048391:3048566 [0] NCCL INFO Using network Socket
axa:3048391:3048566 [0] NCCL INFO Could not get speed from /sys/class/net/lo/speed. Defaulting to 10 Gbps.
"""
# NVIDIA/nccl issue #1597: p5en nodes over EFA through aws-ofi-nccl ("Libfabric"), both hosts' lines mixed.
EFA_LOG = """\
8h200-2:6831:6840 [0] NCCL INFO NET/OFI Creating one domain per process
8h200-2:6831:6840 [0] NCCL INFO NET/OFI Selected Provider is efa (found 16 nics)
8h200-2:6831:6840 [0] NCCL INFO Using network Libfabric
8h200-3:6310:6318 [0] NCCL INFO NET/OFI Selected Provider is efa (found 16 nics)
8h200-3:6310:6318 [0] NCCL INFO NET/OFI NIC group 0 device #0 0000:56:00.0
8h200-3:6310:6318 [0] NCCL INFO Using network Libfabric
8h200-2:14630:14695 [1] NCCL INFO Channel 05/0 : 0[0] -> 1[1] [receive] via NET/AWS Libfabric/1/GDRDMA
"""
# aws/aws-ofi-nccl issue #24: an older plugin ("AWS Libfabric"), mpirun's --tag-output prefix, channel lines only.
TAGGED_LOG = """\
[1,7]<stdout>:ip-172-32-38-1:21471:22316 [7] NCCL INFO Ring 00 : 7 -> 8 [send] via NET/AWS Libfabric/0
[1,26]<stdout>:ip-172-32-36-209:8716:9558 [2] NCCL INFO Ring 00 : 26[2] -> 30[6] via P2P/IPC
[1,15]<stdout>:ip-172-32-34-121:70560:71394 [7] NCCL INFO Ring 00 : 15 -> 16 [send] via NET/Socket/0
"""
# aws-ofi-nccl since 2025 (src/nccl_ofi_net.cpp: "Selected provider is %s, fabric is %s (found %d nics)")
# with libfabric's tcp provider: the plugin loaded, but not on EFA.
OFI_TCP_LOG = """\
node-a:100:200 [0] NCCL INFO NET/OFI Selected provider is tcp, fabric is 10.0.0.0/16 (found 1 nics)
node-a:100:200 [0] NCCL INFO Using network Libfabric
"""

# With NCCL_NET=OFI the plugin names itself "OFI" (aws-ofi-nccl src/nccl_ofi_interface_nvidia.cpp).
OFI_NAMED_LOG = """\
node-b:100:200 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 4 nics)
node-b:100:200 [0] NCCL INFO Using network OFI
"""


@pytest.mark.parametrize(
    "log, expected",
    [
        (SOCKET_LOG, {"axa": "socket"}),
        (EFA_LOG, {"8h200-2": "efa", "8h200-3": "efa"}),
        (TAGGED_LOG, {"ip-172-32-38-1": "libfabric (unknown provider)", "ip-172-32-34-121": "socket"}),
        (OFI_TCP_LOG, {"node-a": "libfabric (tcp)"}),
        (OFI_NAMED_LOG, {"node-b": "efa"}),
        ("all_reduce 64 MB over 2 ranks: 563 ms, algbw 0.95 Gbit/s, busbw 0.95 Gbit/s\n", {}),
    ],
)
def test_the_transport_nccl_chose_is_read_from_its_info_lines(log, expected):
    assert linkcheck.parse_transport(log) == expected


def test_iperf3_json_from_a_real_run_on_loopback():
    if not shutil.which("iperf3"):
        pytest.skip("iperf3 is not installed (make setup installs it)")
    port = str(_free_port())
    server = subprocess.Popen(["iperf3", "-s", "-1", "-p", port], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20  # the server may be slow to listen on a loaded machine
        while time.monotonic() < deadline:
            client = subprocess.run(
                ["iperf3", "-c", "127.0.0.1", "-p", port, "-t", "1", "-P", "3", "-J"], capture_output=True, text=True
            )
            if client.returncode == 0 and not linkcheck.refused(client.stdout):
                break
            time.sleep(0.1)
        assert linkcheck.parse_iperf(client.stdout) > 0.1
        assert linkcheck.iperf_streams(client.stdout) == 3
    finally:
        server.kill()
        server.wait(timeout=30)
    # Nothing listens on port 1: iperf3 -J still exits 0, and only its JSON tells.
    nobody = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", "1", "-t", "1", "-J"], capture_output=True, text=True)
    assert nobody.returncode == 0 and linkcheck.refused(nobody.stdout)
    with pytest.raises(ValueError, match="iperf3: unable to connect"):
        linkcheck.parse_iperf(nobody.stdout)


def test_the_socket_fallback_measures_loopback_over_several_streams():
    port = str(_free_port())
    server = subprocess.Popen(
        [sys.executable, "-m", "cluster_node.programs.linktest", "serve", port, "0.2", "3"],
        stdout=subprocess.PIPE,
        text=True,
    )
    subprocess.run(
        [sys.executable, "-m", "cluster_node.programs.linktest", "send", "127.0.0.1", port, "0.7", "3"], check=True
    )
    out, _ = server.communicate(timeout=30)
    assert json.loads(out)["gbit"] > 0.1 and json.loads(out)["streams"] == 3


@pytest.mark.parametrize(
    "vendor, environ, streams",
    [
        ("0x1d0f", {}, 16),  # AWS ENA: 2 threads x 8 sockets
        ("0x8086", {}, 1),
        (None, {}, 1),  # no PCI device (a veth): 1 x 1
        ("0x1d0f", {"NCCL_SOCKET_NTHREADS": "4"}, 32),
        ("0x1d0f", {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "32"}, 64),  # at most 64 sockets
        ("0x8086", {"NCCL_SOCKET_NTHREADS": "20", "NCCL_NSOCKS_PERTHREAD": "2"}, 32),  # at most 16 threads
    ],
)
def test_the_link_is_measured_with_as_many_streams_as_nccls_socket_transport_opens(vendor, environ, streams):
    """NCCL's socket transport splits every transfer over NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD
    connections; unset, 2 x 8 on AWS's ENA (PCI vendor 0x1d0f), 1 x 1 elsewhere; at most 16 threads
    and 64 sockets (NVIDIA/nccl src/transport/net_socket.cc, ncclSocketGetNsockNthread; NCCL's
    environment-variable docs). EC2 caps one flow at 5 Gbit/s, 10 in a cluster placement group (EC2
    User Guide, "Amazon EC2 instance network bandwidth"): one iperf3 stream cannot see 25-100 Gbit/s."""
    assert linkcheck.nccl_streams(vendor, environ) == streams


def test_the_matmul_peak_line_is_read_into_link_json():
    """Issue 29: `fab check`'s all-reduce program first times the devices' matrix products (the slowest rank)."""
    gpu = "matmul peak: 712 TFLOP/s bfloat16, the slowest of 8 rank(s) (NVIDIA H100 80GB HBM3; datasheet 989.4)\n"
    expected = {"measured_tflops": 712.0, "dtype": "bfloat16", "device": "NVIDIA H100 80GB HBM3"}
    assert linkcheck.parse_peak(gpu + "all_reduce 64 MB over 8 ranks: ...") == expected
    cpu = "matmul peak: 0.113 TFLOP/s float32, the slowest of 3 rank(s) (cpu; no datasheet peak known)\n"
    assert linkcheck.parse_peak(cpu) == {"measured_tflops": 0.113, "dtype": "float32", "device": "cpu"}
    assert linkcheck.parse_peak("busbw 10.0 Gbit/s") is None


def test_link_json_names_slow_pairs_and_the_busbw_share_of_the_median():
    pairs = [
        {"src": "node0", "dst": "node1", "gbit": 0.95},
        {"src": "node1", "dst": "node0", "gbit": 0.96},
        {"src": "node0", "dst": "node2", "gbit": 0.94},
        {"src": "node2", "dst": "node0", "gbit": 0.40},
    ]
    output = "all_reduce 64 MB over 3 ranks: 900 ms, algbw 0.70 Gbit/s, busbw 0.93 Gbit/s\n"
    link = linkcheck.summary(pairs, linkcheck.parse_busbw(output), ["node0", "node1", "node2"], "iperf3")
    assert set(link) >= {"median_gbit", "pairs", "slow_pairs", "allreduce_busbw_gbit", "busbw_fraction"}
    assert set(link) >= {"measured_at", "nodes"}
    assert link["median_gbit"] == 0.945 and link["slow_pairs"] == [pairs[3]]
    assert link["allreduce_busbw_gbit"] == 0.93 and link["busbw_fraction"] == 0.984
    assert linkcheck.parse_busbw("no bench here") is None
    assert link["link_gbit"] == 0.945 and "TCP" in link["link_source"]


def test_on_efa_the_link_is_the_all_reduce_bus_bandwidth_not_the_tcp_matrix():
    """With EFA, NCCL's traffic does not go over TCP at all: the TCP matrix says nothing of its link."""
    from clusterops.predict import bottleneck

    pairs = [{"src": "node0", "dst": "node1", "gbit": 48.0, "streams": 16}]
    link = linkcheck.summary(pairs, 350.0, ["node0", "node1"], "iperf3", efa=True)
    assert link["link_gbit"] == 350.0 and "EFA" in link["link_source"] and link["streams"] == 16
    assert bottleneck.link_rate(link) == 350.0
    tcp = linkcheck.summary(pairs, 40.0, ["node0", "node1"], "iperf3")
    assert bottleneck.link_rate(tcp) == 48.0


def test_exclude_takes_ranks_or_names_and_nodes_counts_what_is_left():
    inv = inventory(nodes=4)
    assert [n.name for n in inv.select(None, ("1", "node3"))] == ["node0", "node2"]
    assert [n.name for n in inv.select(1, ("0",))] == ["node1"]
    with pytest.raises(InventoryError, match="invalid --exclude 7: no such node"):
        inv.select(None, ("7",))
    with pytest.raises(InventoryError, match="leaves no node"):
        inv.select(None, ("0", "1", "2", "3"))
    with pytest.raises(InventoryError, match="invalid --nodes 3: 2 node"):
        inv.select(3, ("0", "1"))


def test_train_with_an_unknown_exclude_is_one_line_and_connects_nowhere(tmp_path):
    path = tmp_path / "inventory.json"
    inventory(nodes=2).save(path)
    result = run_fab("train", "--exclude", "node9", GPU_CLUSTER_INVENTORY=str(path))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: invalid --exclude node9: no such node (the nodes: 0=node0, 1=node1)"
    ]


def test_iperf3_is_in_the_image_and_in_the_set_up():
    from test_image import dockerfile_packages

    assert "iperf3" in dockerfile_packages()
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "iperf3" in re.search(r"APT_PACKAGES=\(([^)]*)\)", setup).group(1).split()


@pytest.mark.parametrize("n", [2, 3, 5, 32])
def test_the_link_rounds_cover_every_ordered_pair_once_with_one_stream_out_and_in_per_node(n):
    names = [f"node{i}" for i in range(n)]
    batches = linkcheck.rounds(names)
    pairs = [pair for batch in batches for pair in batch]
    assert len(batches) == n - 1 and sorted(pairs) == sorted((a, b) for a in names for b in names if a != b)
    for batch in batches:
        assert sorted(src for src, _ in batch) == sorted(names) == sorted(dst for _, dst in batch)


class _Result:
    def __init__(self, exited: int, out: str):
        self.exited, self.stdout, self.stderr = exited, out, ""


class _HeadNode:
    """The head node's connection as far as the all-reduce uses it: each command line is kept; a
    command that forces NCCL's OFI network fails as NCCL does when the plugin did not load."""

    def __init__(self, plugin_loads: bool):
        self.plugin_loads, self.commands = plugin_loads, []

    def run(self, command, **_):
        self.commands.append(command)
        if "NCCL_NET=OFI" in command and not self.plugin_loads:
            return _Result(1, "NCCL WARN Error: network OFI not found.\nncclInvalidUsage")
        return _Result(0, "busbw 10.0 Gbit/s")


@pytest.mark.parametrize("plugin_loads", [True, False])
def test_fab_check_runs_the_all_reduce_as_fab_train_does_on_efa(plugin_loads):
    """Found by a read of the real path: `fab check` ran NCCL unforced while `fab train` forces the
    OFI plugin (NCCL_NET=OFI), so an image whose default plugin is another (NGC images set
    NCCL_NET_PLUGIN) read as sockets and train was refused although the forced path works. Now the
    check runs the forced line first; only when it fails (NCCL: "network OFI not found") does it run
    again unforced, so the verdict names the fallback."""
    efa = inventory(nodes=2)
    efa.extra["efa_cards"] = 4
    head = _HeadNode(plugin_loads)
    output = linkcheck.allreduce(head, efa, efa.nodes, "ens32", "/code", 64, gpus=True)
    assert "busbw" in output
    assert "NCCL_NET=OFI" in head.commands[0]
    assert len(head.commands) == (1 if plugin_loads else 2)
    assert "NCCL_NET=OFI" not in head.commands[-1] or plugin_loads
    plain = _HeadNode(plugin_loads=False)
    linkcheck.allreduce(plain, inventory(nodes=2), inventory(nodes=2).nodes, "ens5", "/code", 64, gpus=True)
    assert len(plain.commands) == 1 and "NCCL_NET" not in plain.commands[0]
