"""Operate the GPU training cluster (AWS or the emulated local one). `fab --list`; `fab --help TASK`.

Typical session:  fab local.up --nodes 2  ->  fab data  ->  fab train --follow  ->  fab fetch  ->  fab local.down
On AWS:           fab preflight -> npx cdk deploy -> fab inventory -> fab status -> fab data ... -> npx cdk destroy
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

from fabric import task
from invoke import Collection
from invoke.exceptions import Exit

from clusterops import cost as costs
from clusterops import launch, localcluster, remote, report
from clusterops.inventory import Inventory
from fabtasks.aws import audit, cost, efs_io_rate, inventory, kept_price, preflight, release_spot, start, stop_cluster
from fabtasks.common import ERRORS, fail, head, inventory_path, load_inventory, number, run_dir, settings, whole_number


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
        code_dir = _code_dir(c, inv)
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
        argv = launch.prepare_argv(inv, dataset, _code_dir(c, inv), shlex.split(extra))
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


def _code_dir(c, inv: Inventory) -> str:
    """The synced copy on /data when `fab sync` made one, else the image's (or checkout's) program."""
    with head(inv) as conn:
        synced = f"{inv.data_dir}/code/train"
        if remote.sh(conn, f"test -f {shlex.quote(synced + '/train.py')} && echo yes || true").strip():
            return synced
    return inv.code_dir


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


@task(
    auto_shortflags=False,  # no -h: help must stay help
    help={
        "recipe": f"one of {', '.join(launch.RECIPES)} (fabric.yaml default: transformer-tiny)",
        "run": "run name (default: the recipe); the same name resumes that run",
        "steps": "max steps",
        "batch_per_gpu": "batch per GPU (per slot locally)",
        "precision": "fp32, fp16 or bf16",
        "grad_compression": "none, fp16, bf16 or powersgd",
        "nodes": "use the first K nodes",
        "dataset": "data set under /data/datasets",
        "follow": "stream the log until the run ends",
        "extra": "more train.py arguments, quoted",
        "stall_minutes": "watchdog: end the run after this long without progress (fabric.yaml: 10)",
        "start_minutes": "watchdog: end the run if no step comes this long after the start (default 15)",
        "master_port": "torch.distributed rendezvous port on the head node (fabric.yaml: 29500)",
        "then_stop": "stop the cluster's instances as soon as the run ends (fab start brings them back)",
    },
)
def train(
    c,
    recipe=None,
    run=None,
    steps=None,
    batch_per_gpu=None,
    precision=None,
    grad_compression=None,
    nodes=None,
    dataset=None,
    follow=False,
    extra="",
    stall_minutes=None,
    start_minutes=None,
    master_port=None,
    then_stop=False,
):
    """Start mpirun across the nodes, detached on the head node, with a watchdog."""
    inv = load_inventory(c)
    defaults = settings(c)
    request = launch.TrainRequest(
        recipe=recipe or defaults["recipe"],
        run=run,
        steps=whole_number(steps, "--steps"),
        batch_per_gpu=whole_number(batch_per_gpu, "--batch-per-gpu"),
        precision=precision,
        grad_compression=grad_compression,
        nodes=whole_number(nodes, "--nodes"),
        dataset=dataset,
        stall_minutes=number(stall_minutes or defaults["stall_minutes"], "--stall-minutes"),
        start_minutes=number(start_minutes or defaults["start_minutes"], "--start-minutes"),
        master_port=whole_number(master_port or defaults["master_port"], "--master-port"),
        then_stop=then_stop,
        extra_args=tuple(shlex.split(extra)),
    )
    try:
        request.validate()
        code_dir = _code_dir(c, inv)
        with head(inv) as conn:
            rdir, log_offset = remote.start_training(conn, inv, request, code_dir)
            print(f"started {request.run_name} in {rdir} on {len(inv.select(request.nodes))} node(s) ({code_dir})")
            if follow:
                _follow(conn, rdir, log_offset, _projector(inv))
    except ERRORS as error:
        raise fail(error) from None


def _projector(inv: Inventory):
    """On AWS: print once what the run will cost (nodes and EFS I/O), as soon as its step time is
    known; "unknown" where no price is known, never an exception after the run has started."""
    if inv.source != "aws":
        return None
    price = kept_price(inv, inv.instance_type) or costs.offline_price(inv.instance_type, inv.region or "us-east-1")
    hourly = None if price.usd_per_hour is None else price.usd_per_hour * len(inv.nodes)
    printed: list[str] = []

    def on_progress(progress: dict) -> None:
        if printed or not costs.projection(progress, hourly):
            return
        line = costs.projection(progress, hourly, efs_io_rate(inv)) or ""
        print(f"cost: {line} [{price.source}]", flush=True)
        printed.append(line)

    return on_progress


def _follow(conn, rdir: str, offset: int = 0, on_progress=None) -> None:
    status_ = remote.follow_log(conn, rdir, offset=offset, on_progress=on_progress)
    state = remote.run_state(conn, rdir)
    print(report.run_line(rdir, state))
    for line in report.summary_lines(state["summary"]):
        print(line)
    if status_.get("state") != "finished":
        raise Exit(f"error: run {status_.get('state')}: {status_.get('reason')}", code=1)


@task(help={"run": "run name (default: the active or latest run)", "follow": "keep streaming"})
def logs(c, run=None, follow=False):
    """Print a run's log (train.log on /data); --follow streams it until the run ends."""
    inv = load_inventory(c)
    with head(inv) as conn:
        rdir = run_dir(conn, inv, run)
        if follow:
            _follow(conn, rdir)
        else:
            remote.follow_log(conn, rdir, follow=False)


@task(help={"run": "run name (default: the active run)", "force": "kill instead of checkpoint-and-exit"})
def stop(c, run=None, force=False):
    """Stop a run gracefully: checkpoint at the next step, then exit (`--force` kills it)."""
    inv = load_inventory(c)
    try:
        with head(inv) as conn:
            rdir = run_dir(conn, inv, run) if run else remote.active_run(conn, inv)
            if not rdir:
                raise remote.RemoteError("no run is going")
            if force:
                remote.force_stop(conn, inv, rdir)
                print(f"killed {rdir}")
            else:
                result = remote.request_stop(conn, rdir)
                print(f"stopped {rdir}: {result.get('state')} {result.get('reason', '')}")
    except ERRORS as error:
        raise fail(error) from None


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
    """GPU utilisation, network rx/tx (Mbit/s) and load per node, sampled live."""
    inv = load_inventory(c)
    interval, count = number(interval, "--interval"), whole_number(count, "--count")

    taken = 0
    while count == 0 or taken < count:
        rows = remote.on_all(inv, inv.nodes, lambda conn, node: remote.sample_node(conn, node, interval))
        print(time.strftime("%H:%M:%S"))
        print(report.table(rows, ["node", "gpu_util", "rx_mbit", "tx_mbit", "load", "error"]))
        taken += 1


@task(help={"run": "run name (default: the latest)", "dest": "local directory (default ./runs)"})
def fetch(c, run=None, dest="runs"):
    """Checkpoint, config, vocabulary, summary.json and eval texts into ./runs/NAME/."""
    inv = load_inventory(c)
    with head(inv) as conn:
        rdir = run_dir(conn, inv, run)
        target = Path(dest) / Path(rdir).name
        files, previous = remote.fetch_run(conn, rdir, target)
    print(
        f"fetched {len(files)} file(s) into {target}/" + (f" (the earlier copy is now {previous}/)" if previous else "")
    )


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


@task(
    name="up",
    help={
        "nodes": "node count (default 2)",
        "link": "cap each link, e.g. 1gbit",
        "slots": "ranks per node (default 1)",
        "name": "cluster name (default local)",
        "subnet": "node addresses (default 10.213.0.0/24)",
        "replace": "replace a running cluster of that name, deleting its /data",
    },
)
def local_up(c, nodes="2", link=None, slots="1", name="local", subnet="10.213.0.0/24", replace=False):
    """Start an emulated cluster on this machine (root): namespaces, sshd on 4444, shared /data."""
    spec = localcluster.LocalSpec(
        name=name, nodes=whole_number(nodes, "--nodes"), slots=whole_number(slots, "--slots"), link=link, subnet=subnet
    )
    started = time.perf_counter()
    try:
        inv = localcluster.up(spec, inventory_path(c), replace=replace)
    except ERRORS as error:
        raise fail(error) from None
    print(
        f"local cluster {name}: {len(inv.nodes)} node(s) "
        f"{', '.join(n.private_ip for n in inv.nodes)} up in {time.perf_counter() - started:.2f} s"
        + (f", links capped at {link}" if link else "")
    )


@task(name="down", help={"name": "cluster name (default local)"})
def local_down(c, name="local"):
    """Stop the emulated cluster: no namespace, bridge, process or mount is left behind."""
    unfetched = localcluster.unfetched_runs(localcluster.STATE_ROOT / name / "shared")
    try:
        removed = localcluster.down(name, inventory_path(c))
    except localcluster.NothingToDo as nothing:
        print(nothing)
        return
    except ERRORS as error:
        raise fail(error) from None
    if unfetched:
        print(
            f"deleted with /data, never fetched: runs {', '.join(unfetched)} "
            "(next time: `fab fetch --run NAME` before `fab local.down`)"
        )
    print(f"local cluster {name} down ({len(removed)} namespace(s)/bridge removed)")


local = Collection("local", local_up, local_down)
ns = Collection(
    preflight,
    cost,
    audit,
    release_spot,
    start,
    stop_cluster,
    inventory,
    status,
    check,
    data,
    sync,
    train,
    logs,
    stop,
    tensorboard,
    monitor,
    fetch,
    ssh,
    local,
)
