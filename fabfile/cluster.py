"""Tasks on the cluster's nodes: status, check, data, sync, tensorboard, monitor, ssh."""

from __future__ import annotations

import os
import posixpath
import shlex
import time
from pathlib import Path

from invoke.exceptions import Exit

import cluster_node
from cluster_node.supervisor import restart_plan
from clusterops import terminal
from clusterops.nodes import command as nodecmd
from clusterops.nodes import health, remote
from clusterops.nodes import view as nodeview
from clusterops.run import checkup, dataprep, lifecycle, linkcheck
from clusterops.run import tensorboard as board
from stacks import images

from .common import head, load_inventory, number, progress, task, whole_number


@task
def status(c):
    """Per node: reachable, bootstrap, deploy time, container, /data, GPUs; the run.

    Per node, in parallel: reachable, bootstrap, the deploy's total time, container, /data, GPUs, training;
    then each node's deploy timeline (its bootstrap's steps) and the run."""
    inv = load_inventory(c)
    with remote.Connections(inv) as connections:
        rows = remote.on_all(inv, inv.nodes, lambda conn, node: nodeview.node_status(conn, inv, node), connections)
        print(
            terminal.table(
                rows, ["node", "reachable", "bootstrap", "deploy", "container", "data", "gpus", "training", "error"]
            )
        )
        for row in rows:
            if row.get("deploy_timeline"):
                print(terminal.deploy_line(row["node"], row["deploy_timeline"]))
        overview = lifecycle.run_overview(connections.get(inv.head), inv) if rows[0].get("reachable") else None
    if overview:
        print(terminal.run_line(*overview))
        for line in restart_plan.history_lines([restart.to_json() for restart in overview[1].restarts]):
            print(line)
    if inv.extra.get("dashboard_url"):
        print(f"dashboard: {inv.extra['dashboard_url']}")


# Numeric options default to strings: Invoke would infer a parser from a number and print a
# traceback for "abc" before the task runs; the task parses them (one line on bad input).
@task(
    help={
        "mb": f"all-reduce payload in MB (default {checkup.ALLREDUCE_MB:g})",
        "seconds": "seconds per direction of each pair's TCP test "
        f"(default {checkup.PAIR_SECONDS}, after 1 s of ramp-up)",
        "quick": "only the per-node probe (what `fab train` runs first): no links, all-reduce or training steps",
        "streams": "TCP streams per pair (default: as many as NCCL's socket transport opens on the NIC: 16 on AWS)",
        "json": "machine-readable output: {fit_to_train, problems, nodes: [{node, verdict (ok|degraded|bad), "
        "reasons, notes, details}], "
        "link: {link_gbit, link_source, streams, median_gbit, pairs: [{src, dst, gbit, tool, streams}], "
        "slow_pairs, allreduce_busbw_gbit, busbw_fraction, measured_at, nodes, tool}, training}",
    }
)
def check(c, mb=None, seconds=None, quick=False, json=False, streams=None):
    """A health verdict per node, then the links, the all-reduce and a few steps.

    A health verdict per node (ok / degraded / bad, with reasons): GPUs, ECC, Xid, versions, /data,
    clock; then the TCP link between every pair, the all-reduce bus bandwidth against it, the NCCL
    transport and a few real training steps. Exit code 0 only when fit to train (no bad node)."""
    inv = load_inventory(c)
    payload, per_pair = number(mb, "--mb"), whole_number(seconds, "--seconds")
    if per_pair is not None and per_pair < 1:
        raise Exit(f"error: invalid --seconds {seconds!r}: at least 1", code=1)
    count = whole_number(streams, "--streams") if streams is not None else None
    if count is not None and not 1 <= count <= linkcheck.MAX_SOCKETS:
        raise Exit(f"error: invalid --streams {streams!r}: 1 to {linkcheck.MAX_SOCKETS}", code=1)
    say = (lambda *a, **k: None) if json else print
    checked = checkup.check(inv, (payload, per_pair, count), quick, say=say, progress=progress)
    verdicts, link, training, problems, fit = (
        checked.verdicts,
        checked.link,
        checked.training,
        checked.problems,
        checked.fit,
    )
    if json:
        print(health.as_json(verdicts, fit_to_train=fit, problems=problems, link=link, training=training))
    else:
        _print_check(verdicts, checked.interfaces, checked.facts, link, training, problems, _cluster_image(inv))
    if not fit:
        bad = [f"{h.node} ({'; '.join(h.reasons)})" for h in verdicts if h.verdict == "bad"]
        raise Exit("error: not fit to train: " + "; ".join(bad + problems), code=1)


def _cluster_image(inv) -> str:
    """The image the nodes were built from: the inventory's, else cdk.json's `image` context, else the default."""
    import json as json_module

    context = json_module.loads(Path("cdk.json").read_text()).get("context", {}) if Path("cdk.json").is_file() else {}
    return inv.extra.get("image") or context.get("image") or images.DEFAULT_IMAGE


def _print_check(verdicts, interfaces, facts, link, training, problems, image=images.DEFAULT_IMAGE) -> None:
    rows = [
        {
            "node": h.node,
            "verdict": h.verdict,
            "interface": interfaces.get(h.node, ""),
            "gpus": f"{h.details['gpus']} {h.details['gpu'] or ''}".strip() if h.details else "",
            "transport": (h.details or {}).get("transport") or "",
            "reasons": "; ".join(h.reasons + h.notes),
        }
        for h in verdicts
    ]
    print(terminal.table(rows, ["node", "verdict", "interface", "gpus", "transport", "reasons"]))
    reachable = [{"node": n, **{k: f.get(k) for k in ("torch", "cuda", "nccl")}} for n, f in facts.items() if f]
    for row in reachable:
        gpus = facts[row["node"]]["gpus"]
        row["driver"] = gpus[0]["driver"] if gpus else None
    if reachable:
        print(terminal.versions_line(reachable)[1])
        print(images.compare_nodes(image, reachable))
    if link:
        pairs = ", ".join(f"{p['src']}->{p['dst']} {p['gbit']:.2f}" for p in link["pairs"])
        slow = ", ".join(f"{p['src']}->{p['dst']}" for p in link["slow_pairs"]) or "none"
        print(f"link ({link['tool']}): median {link['median_gbit']:.2f} Gbit/s; {pairs}; slow links: {slow}")
        taken = f"{link['link_gbit'] or 0:.2f} Gbit/s ({link['link_source']})"
        print(f"TCP streams per pair: {link['streams']}; the link: {taken}")
        if link["busbw_fraction"] is not None:
            print(
                f"all-reduce busbw {link['allreduce_busbw_gbit']:.2f} Gbit/s = "
                f"{link['busbw_fraction']:.2f} of the measured link"
            )
    if training:
        print(training)
    for problem in problems:
        print(f"problem: {problem}")


@task(
    help={
        "dataset": "numbers (offline, default), ding (real sentences from Debian's trans-de-en), "
        "wmt16-en-de (downloads ~1.5 GB), fashion-mnist (real images from Debian's dataset-fashion-mnist, "
        "resnet-small's default) or imagenet (check/stage)",
        "extra": 'more prepare.py arguments, quoted, e.g. "--stage-to /opt/dlami/nvme/imagenet"',
        "all_nodes": "run on every node (imagenet --stage-to: each node's own disk)",
    }
)
def data(c, dataset="numbers", extra="", all_nodes=False):
    """Prepare a data set on /data, from the head node or on every node.

    Prepare a data set on /data from the head node (prepare.py), or on every node."""
    inv = load_inventory(c)
    dataprep.prepare(inv, dataset, shlex.split(extra), all_nodes, progress=progress)
    staged = dataprep.staged_to(shlex.split(extra))
    if staged:
        every = all_nodes or len(inv.nodes) == 1
        train = f"train from it: fab train --data {staged} (each node reads its own copy; without --data, /data)"
        only = "only the head node holds this copy: `fab train --data` needs one on every node (--all-nodes)"
        print(
            (train if every else only) + "\n"
            "note: instance-store NVMe (e.g. /opt/dlami/nvme) is erased when a node stops (autostop, "
            "--then-stop, fab stop-cluster): run this `fab data` again after `fab start`"
        )


@task(help={"source": "the training package's directory: __init__.py and train.py (default assets/train)"})
def sync(c, source="assets/train"):
    """Copy the training program and the node package to /data/code.

    Copy the training program (or your own directory) to /data/code/train and the node package beside
    it (/data/code/cluster_node); train then uses them."""
    inv = load_inventory(c)
    src = Path(source)
    # The ranks run `python -m train.train` from /data/code: the directory must be the package `train`.
    missing = [name for name in ("__init__.py", "train.py") if not (src / name).is_file()]
    if missing:
        raise Exit(f"error: --source {source!r} is not the training package: no {' or '.join(missing)}", code=1)
    root = nodecmd.synced_root(inv)
    with head(inv) as conn:
        count = _put_tree(conn, src, posixpath.join(root, "train"))
        count += _put_tree(conn, Path(cluster_node.__file__).parent, posixpath.join(root, "cluster_node"))
    print(f"synced {count} file(s) to {root}")


def _put_tree(conn, src: Path, target: str) -> int:
    """Every file under `src` (no bytecode) to `target` on the node; how many."""
    files = [p for p in sorted(src.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    folders = sorted({posixpath.join(target, p.relative_to(src).parent.as_posix()) for p in files} | {target})
    remote.sh(conn, "mkdir -p " + " ".join(shlex.quote(posixpath.normpath(f)) for f in folders))
    for path in files:
        conn.put(str(path), posixpath.join(target, path.relative_to(src).as_posix()))
    return len(files)


@task(help={"port": f"local port (default {board.LOCAL_PORT})", "stop": "stop the head node's TensorBoard instead"})
def tensorboard(c, port=None, stop=False):
    """TensorBoard on the head node, through an SSH tunnel.

    TensorBoard on the head node (started if needed), through an SSH tunnel: nothing opened."""
    inv = load_inventory(c)
    local_port = whole_number(port, "--port")
    local_port = board.LOCAL_PORT if local_port is None else local_port
    with head(inv) as conn:
        if stop:
            print("TensorBoard stopped" if board.stop_tensorboard(conn) else "no TensorBoard was running")
            return
        if not _port_free(local_port):
            raise Exit(
                f"error: local port {local_port} is in use (another `fab tensorboard`?): close it or pass --port N",
                code=1,
            )
        board.ensure_tensorboard(conn, inv)
        with conn.forward_local(local_port, remote_port=board.TENSORBOARD_PORT, remote_host="127.0.0.1"):
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


@task(
    help={
        "interval": f"seconds per sample (default {nodeview.SAMPLE_SECONDS})",
        "count": "samples (default: until Ctrl-C)",
    }
)
def monitor(c, interval=None, count="0"):
    """Live, per node: CPU, GPU utilisation, network against the link.

    Per node, sampled live: CPU cores its processes use, GPU utilisation, network rx/tx in Mbit/s
    and as a share of the link `fab check` measured."""
    from clusterops.run import analysis

    inv = load_inventory(c)
    interval, count = number(interval, "--interval"), whole_number(count, "--count")
    interval = nodeview.SAMPLE_SECONDS if interval is None else interval
    taken = 0
    with remote.Connections(inv) as connections:  # kept open from one sample to the next
        link_gbit, link_text = analysis.measured_link_gbit(connections.get(inv.head), inv)
        print(f"link share: of {link_text}")
        while count == 0 or taken < count:
            rows = remote.on_all(
                inv,
                inv.nodes,
                lambda conn, node: nodeview.sample_node(conn, inv, node, interval, link_gbit),
                connections,
            )
            print(time.strftime("%H:%M:%S"))
            columns = ["node", "cpu", "gpu_util", "rx_mbit", "rx_link", "tx_mbit", "tx_link", "error"]
            print(terminal.table(rows, columns))
            taken += 1


@task(help={"node": "the node: its rank or name, as --exclude takes them (default 0, the head)"})
def ssh(c, node="0"):
    """An interactive shell in a node's training container."""
    inv = load_inventory(c)
    target = inv.node(str(node))
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
