"""Tasks on the cluster's nodes: status, check, data, sync, tensorboard, monitor, ssh."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

from fabric import task
from invoke.exceptions import Exit

from clusterops import launch, remote, report

from .common import ERRORS, fail, head, load_inventory, number, training_code_dir, whole_number


@task
def status(c):
    """Per node, in parallel: reachable, bootstrap, container, /data, GPUs, training; then the run."""
    inv = load_inventory(c)
    rows = remote.on_all(inv, inv.nodes, lambda conn, node: remote.node_status(conn, inv, node))
    print(report.table(rows, ["node", "reachable", "bootstrap", "container", "data", "gpus", "training", "error"]))
    head_row = rows[0]
    if head_row.get("reachable"):
        with head(inv) as conn:
            latest = remote.active_run(conn, inv) or remote.latest_run(conn, inv)
            if latest:
                print(report.run_line(latest, remote.run_state(conn, latest)))
    if inv.extra.get("dashboard_url"):
        print(f"dashboard: {inv.extra['dashboard_url']}")


# Numeric options default to strings: Invoke would infer a parser from a number and print a
# traceback for "abc" before the task runs; the task parses them (one line on bad input).
@task(help={"mb": "all-reduce payload in MB (default 64)"})
def check(c, mb="64"):
    """Per node: hostname, interface, torch/CUDA/NCCL/driver versions (must agree); then mpirun
    hostname, an all-reduce bandwidth test and a few real training steps with the trainer's collectives."""
    inv = load_inventory(c)
    rows = remote.on_all(
        inv,
        inv.nodes,
        lambda conn, node: {
            "interface": remote.detect_interface(conn, node),
            "hostname": remote.sh(conn, "hostname").strip(),
            **remote.node_versions(conn, inv),
        },
    )
    print(
        report.table(rows, ["node", "reachable", "hostname", "interface", "torch", "cuda", "nccl", "driver", "error"])
    )
    interfaces = {row.get("interface") for row in rows}
    if not all(row["reachable"] for row in rows) or len(interfaces) != 1:
        raise Exit("error: nodes unreachable or interfaces differ; NCCL/GLOO_SOCKET_IFNAME needs one name", code=1)
    same, versions = report.versions_line(rows)
    if not same:
        raise Exit(f"error: {versions}", code=1)
    print(versions)
    prefix = launch.mpirun_prefix(inv, inv.nodes, interfaces.pop())
    try:
        code_dir = training_code_dir(inv)
        with head(inv) as conn:
            remote.ensure_idle(conn, inv)
            for argv in (
                prefix + ["hostname"],
                prefix + [inv.python, f"{code_dir}/bench_allreduce.py", "--mb", str(number(mb, "--mb"))],
            ):
                print(remote.sh(conn, "timeout 300 " + shlex.join(argv)).strip(), flush=True)
            print(remote.check_training(conn, inv, prefix, code_dir))
    except ERRORS as error:
        raise fail(error) from None


@task(
    help={
        "dataset": "numbers (offline, default), wmt16-en-de (downloads ~1.5 GB) or imagenet (check/stage)",
        "extra": 'more prepare.py arguments, quoted, e.g. "--stage-to /opt/dlami/nvme/imagenet"',
        "all_nodes": "run on every node (imagenet --stage-to: each node's own disk)",
    }
)
def data(c, dataset="numbers", extra="", all_nodes=False):
    """Prepare a data set on /data from the head node (prepare.py), or on every node."""
    inv = load_inventory(c)
    try:
        argv = launch.prepare_argv(inv, dataset, training_code_dir(inv), shlex.split(extra))
    except ERRORS as error:
        raise fail(error) from None
    for node in inv.nodes if all_nodes else [inv.head]:
        with remote.connect(inv, node) as conn:
            result = conn.run(shlex.join(argv), in_stream=False, warn=True)
        if result.exited != 0:
            raise Exit(f"error: prepare.py {dataset} failed on {node.name} (exit {result.exited})", code=1)
    if "--stage-to" in extra:
        print(
            "note: instance-store NVMe (e.g. /opt/dlami/nvme) is erased when a node stops (autostop, "
            "--then-stop, fab stop-cluster): run this `fab data` again after `fab start`"
        )


@task(help={"source": "local directory with train.py (default assets/train)"})
def sync(c, source="assets/train"):
    """Copy the training program (or your own directory) to /data/code/train; train then uses it."""
    inv = load_inventory(c)
    src = Path(source)
    if not (src / "train.py").is_file():
        raise Exit(f"error: --source {source!r} has no train.py", code=1)
    target = f"{inv.data_dir}/code/train"
    with head(inv) as conn:
        remote.sh(conn, f"mkdir -p {shlex.quote(target)}")
        files = [p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        for path in files:
            rel = path.relative_to(src).as_posix()
            remote.sh(conn, f"mkdir -p {shlex.quote(str(Path(target, rel).parent))}")
            conn.put(str(path), f"{target}/{rel}")
    print(f"synced {len(files)} file(s) to {target}")


@task(help={"port": "local port (default 6006)", "stop": "stop the head node's TensorBoard instead"})
def tensorboard(c, port="6006", stop=False):
    """TensorBoard on the head node (started if needed), through an SSH tunnel: nothing opened."""
    inv = load_inventory(c)
    local_port = whole_number(port, "--port")
    with head(inv) as conn:
        if stop:
            print("TensorBoard stopped" if remote.stop_tensorboard(conn) else "no TensorBoard was running")
            return
        if not _port_free(local_port):
            raise Exit(
                f"error: local port {local_port} is in use (another `fab tensorboard`?): close it or pass --port N",
                code=1,
            )
        try:
            remote.ensure_tensorboard(conn, inv)
        except ERRORS as error:
            raise fail(error) from None
        with conn.forward_local(local_port, remote_port=remote.TENSORBOARD_PORT, remote_host="127.0.0.1"):
            print(f"TensorBoard: http://localhost:{local_port} (Ctrl-C to close the tunnel)")
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@task(help={"interval": "seconds per sample (default 2)", "count": "samples (default: until Ctrl-C)"})
def monitor(c, interval="2", count="0"):
    """Per node, sampled live: CPU cores its processes use, GPU utilisation, network rx/tx in Mbit/s
    and as a share of the link `fab check` measured."""
    from clusterops import analysis

    inv = load_inventory(c)
    interval, count = number(interval, "--interval"), whole_number(count, "--count")
    with head(inv) as conn:
        link_gbit, link_text = analysis.measured_link_gbit(conn, inv)
    print(f"link share: of {link_text}")
    taken = 0
    while count == 0 or taken < count:
        rows = remote.on_all(
            inv, inv.nodes, lambda conn, node: remote.sample_node(conn, node, interval, inv.python, link_gbit)
        )
        print(time.strftime("%H:%M:%S"))
        columns = ["node", "cpu", "gpu_util", "rx_mbit", "rx_link", "tx_mbit", "tx_link", "error"]
        print(report.table(rows, columns))
        taken += 1


@task(help={"node": "rank of the node (default 0, the head)"})
def ssh(c, node="0"):
    """An interactive shell in a node's training container."""
    inv = load_inventory(c)
    rank = whole_number(node, "--node")
    target = inv.nodes[rank] if 0 <= rank < len(inv.nodes) else None
    if target is None:
        raise Exit(f"error: --node {node}: the cluster has nodes 0-{len(inv.nodes) - 1}", code=1)
    proxy = ["-o", f"ProxyCommand={inv.ssh.proxy_command}"] if inv.ssh.proxy_command else []
    os.execvp(
        "ssh",
        [
            "ssh",
            "-i",
            inv.ssh.key_file,
            "-p",
            str(inv.ssh.port),
            *proxy,
            "-o",
            f"UserKnownHostsFile={inv.ssh.known_hosts}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "IdentitiesOnly=yes",
            f"{inv.ssh.user}@{target.public_ip}",
        ],
    )
