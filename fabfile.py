"""Operate the GPU training cluster (AWS or the emulated local one). `fab --list`; `fab --help TASK`.

Typical session:  fab local.up --nodes 2  ->  fab data  ->  fab train --follow  ->  fab fetch  ->  fab local.down
On AWS:           npx cdk deploy  ->  fab inventory  ->  fab status  ->  fab data ...  ->  npx cdk destroy
"""
from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

from fabric import task
from invoke import Collection
from invoke.exceptions import Exit

from clusterops import audit as audits
from clusterops import cost as costs
from clusterops import launch, localcluster, preflight as checks, remote, report
from clusterops.inventory import (DEFAULT_INVENTORY, DEFAULT_OUTPUTS, Inventory, InventoryError,
                                  from_outputs, stack_outputs_from_aws, stack_outputs_from_file,
                                  start_and_refresh)

ERRORS = (InventoryError, launch.LaunchError, remote.RemoteError, localcluster.LocalClusterError)


def _fail(error: Exception) -> Exit:
    return Exit(f"error: {error}", code=1)


def _aws_session(region=None):
    """A boto3 session, or one actionable line when the AWS configuration is broken."""
    import boto3
    from botocore.exceptions import BotoCoreError
    try:
        session = boto3.session.Session(region_name=region)
        session.get_credentials()
        return session
    except BotoCoreError as error:
        raise Exit(f"error: AWS configuration: {error} (check AWS_PROFILE / `aws configure`)", code=1) from None


def _settings(c) -> dict:
    """fabric.yaml's gpu_cluster section, with the built-in defaults under it."""
    defaults = {"inventory": str(DEFAULT_INVENTORY), "recipe": "transformer-tiny", "master_port": 29500,
                "stall_minutes": 10}
    return {**defaults, **dict(c.config.get("gpu_cluster", {}))}


def _inventory_path(c) -> Path:
    return Path(os.environ.get("GPU_CLUSTER_INVENTORY") or _settings(c)["inventory"])


def _inventory(c) -> Inventory:
    path = _inventory_path(c)
    if not path.exists() and DEFAULT_OUTPUTS.exists():
        raise _fail(InventoryError(f"{DEFAULT_OUTPUTS} exists but no inventory: run `fab inventory`"))
    if path.exists() and DEFAULT_OUTPUTS.exists() \
            and DEFAULT_OUTPUTS.stat().st_mtime > path.stat().st_mtime \
            and Inventory.load(path).source == "aws":
        raise _fail(InventoryError("the inventory is older than the last deploy: run `fab inventory`"))
    try:
        return Inventory.load(path)
    except InventoryError as error:
        raise _fail(error) from None


def _head(inv: Inventory):
    return remote.connect(inv, inv.head)


def _run_dir(connection, inv: Inventory, run: str | None) -> str:
    if run:
        return launch.run_dir(inv, run)
    latest = remote.active_run(connection, inv) or remote.latest_run(connection, inv)
    if not latest:
        raise _fail(remote.RemoteError("no runs yet: start one with `fab train`"))
    return latest


def _cluster_config(**overrides):
    """cdk.json's context with the task's overrides, validated like `cdk synth` does."""
    import json
    from stacks.config import ClusterConfig, ConfigError
    context = json.loads(Path("cdk.json").read_text()).get("context", {})
    try:
        return ClusterConfig.from_context({**context, **{k: v for k, v in overrides.items() if v is not None}})
    except ConfigError as error:
        raise _fail(error) from None


@task(help={"nodes": "node count (default: cdk.json)", "instance_type": "instance type (default: cdk.json)",
            "request_quota": "file the vCPU quota increase through Service Quotas when short",
            "spot": "check the Spot quota bucket instead of On-Demand"})
def preflight(c, nodes=None, instance_type=None, request_quota=False, spot=False):
    """Before `cdk deploy`: credentials, region, offering, vCPU quota, a RunInstances dry run, the AMI."""
    config = _cluster_config(nodes=nodes, instance_type=instance_type)
    session = _aws_session()
    clients = {name: session.client(name) for name in ("sts", "ec2", "ssm", "service-quotas")} \
        if session.region_name else {"sts": session.client("sts", region_name="us-east-1")}
    found, notes = checks.run_preflight(clients, session.region_name, config.instance_type, config.nodes,
                                        config.ami_ssm_parameter, request_quota=request_quota, spot=spot)
    for check in found:
        print(f"{'ok  ' if check.ok else 'FAIL'}  {check.name}: {check.detail}")
    for note in notes:
        print(note)
    if not all(check.ok for check in found):
        raise Exit("error: preflight failed; fix the FAIL lines before `cdk deploy`", code=1)


@task(help={"nodes": "node count (default: the inventory, else cdk.json)",
            "instance_type": "instance type (default: the inventory, else cdk.json)"})
def cost(c, nodes=None, instance_type=None):
    """$/hour of the cluster, storage per month, the running job's projection and what was spent."""
    inv = Inventory.load(_inventory_path(c)) if _inventory_path(c).exists() else None
    aws = inv is not None and inv.source == "aws"
    config = _cluster_config(nodes=nodes or (len(inv.nodes) if aws else None),
                             instance_type=instance_type or (inv.instance_type if aws else None))
    session = _aws_session(inv.region if aws else None)
    region = session.region_name or "us-east-1"
    try:
        from botocore.config import Config
        pricing = session.client("pricing", region_name="us-east-1",
                                 config=Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 1}))
        price = costs.instance_price(pricing, config.instance_type, region)
    except KeyError as error:
        raise Exit(f"error: {error.args[0]}", code=1) from None
    efs_gb = 0.0
    if aws and DEFAULT_OUTPUTS.exists():
        _, outputs = stack_outputs_from_file(DEFAULT_OUTPUTS)
        fs = session.client("efs").describe_file_systems(FileSystemId=outputs["FileSystemId"])["FileSystems"][0]
        efs_gb = fs["SizeInBytes"]["Value"] / 1e9
    estimate = costs.Estimate(config.nodes, price, config.root_volume_gb, efs_gb)
    print("\n".join(estimate.lines()))
    if aws:
        ids = [n.instance_id for n in inv.nodes if n.instance_id]
        reservations = session.client("ec2").describe_instances(InstanceIds=ids)["Reservations"]
        launched = [i["LaunchTime"] for r in reservations for i in r["Instances"] if i["State"]["Name"] == "running"]
        print(f"spent since the running nodes started: ${costs.spent(launched, price.usd_per_hour):.2f}")
    if inv is not None:
        with _head(inv) as conn:
            run = remote.active_run(conn, inv)
            line = run and costs.projection(remote.run_state(conn, run)["progress"], estimate.usd_per_hour)
        print(line or "no run going")


@task
def start(c):
    """Start the cluster's stopped nodes (after autostop or --then-stop) and refresh the inventory."""
    inv = _inventory(c)
    try:
        fresh = start_and_refresh(inv, _aws_session(inv.region).client("ec2"))
    except ERRORS as error:
        raise _fail(error) from None
    fresh.save(_inventory_path(c))
    print(f"{len(fresh.nodes)} node(s) running; head {fresh.head.public_ip}; run `fab status` once they are ready")


@task(help={"cluster": "cluster name (default: the inventory's, else cdk.json's)",
            "delete": "delete what is found, after confirmation", "yes": "do not ask (scripts)"})
def audit(c, cluster=None, delete=False, yes=False):
    """Anything still tagged with the cluster, with its monthly cost; --delete removes it."""
    inv = Inventory.load(_inventory_path(c)) if _inventory_path(c).exists() else None
    name = cluster or (inv.cluster if inv and inv.source == "aws" else _cluster_config().cluster_name)
    session = _aws_session(inv.region if inv and inv.region else None)
    if not session.region_name:
        raise Exit("error: no AWS region: set AWS_REGION or `aws configure`", code=1)
    clients = {k: session.client(k) for k in ("ec2", "efs", "ssm", "logs", "cloudwatch")}
    leftovers = audits.find(clients, name)
    if not leftovers:
        print(f"nothing tagged gpu-cluster:name={name} in {session.region_name}")
        return
    rows = [{"kind": x.kind, "id": x.id, "detail": x.detail, "usd_per_month": f"{x.usd_per_month:.2f}"}
            for x in leftovers]
    print(report.table(rows, ["kind", "id", "detail", "usd_per_month"]))
    print(f"total: ${sum(x.usd_per_month for x in leftovers):.2f}/month in {session.region_name}")
    if not delete:
        return
    if not yes and input(f"delete these {len(leftovers)} resources? type {name} to confirm: ").strip() != name:
        raise Exit("nothing deleted", code=1)
    failed = audits.delete(clients, leftovers)
    if failed:
        raise Exit(f"error: {len(failed)} resource(s) could not be deleted; run `fab audit` again", code=1)


@task(help={"stack": "stack name (default: the one cluster stack in the outputs file)",
            "outputs": f"cdk outputs file (default {DEFAULT_OUTPUTS})",
            "from_aws": "describe the stack with boto3 instead of reading the outputs file",
            "key_file": "private key of your own key pair (when deployed with -c key_name=...)"})
def inventory(c, stack=None, outputs=str(DEFAULT_OUTPUTS), from_aws=False, key_file=None):
    """Build .cluster/inventory.json from the deploy outputs; fetch the SSH key and host key once."""
    try:
        if from_aws:
            if not stack:
                raise InventoryError("--from-aws needs --stack NAME")
            session = _aws_session()
            name, outs = stack, stack_outputs_from_aws(stack, session)
        else:
            name, outs = stack_outputs_from_file(Path(outputs))
            if stack and stack != name:
                raise InventoryError(f"{outputs} holds stack {name}, not {stack}")
            session = _aws_session(outs.get("Region"))
        target = _inventory_path(c)
        inv = from_outputs(name, outs, session, target.parent / "keys", key_file=key_file)
    except ERRORS as error:
        raise _fail(error) from None
    inv.save(target)
    print(f"{target}: {len(inv.nodes)} node(s) of {inv.instance_type}, head {inv.head.public_ip}")


@task
def status(c):
    """Per node, in parallel: reachable, bootstrap, container, /data, GPUs, training; then the run."""
    inv = _inventory(c)
    rows = remote.on_all(inv, inv.nodes, lambda conn, node: remote.node_status(conn, inv, node))
    print(report.table(rows, ["node", "reachable", "bootstrap", "container", "data", "gpus",
                              "training", "error"]))
    head_row = rows[0]
    if head_row.get("reachable"):
        with _head(inv) as conn:
            latest = remote.active_run(conn, inv) or remote.latest_run(conn, inv)
            if latest:
                print(report.run_line(latest, remote.run_state(conn, latest)))


@task(help={"mb": "all-reduce payload in MB (default 64)"})
def check(c, mb=64):
    """mpirun hostname on every node, the network interface of each, and an all-reduce bandwidth test."""
    inv = _inventory(c)
    rows = remote.on_all(inv, inv.nodes, lambda conn, node: {
        "interface": remote.detect_interface(conn, node),
        "hostname": remote.sh(conn, "hostname").strip()})
    print(report.table(rows, ["node", "reachable", "hostname", "interface", "error"]))
    interfaces = {row.get("interface") for row in rows}
    if not all(row["reachable"] for row in rows) or len(interfaces) != 1:
        raise Exit("error: nodes unreachable or interfaces differ; NCCL/GLOO_SOCKET_IFNAME needs one name",
                   code=1)
    interface = interfaces.pop()
    request = launch.TrainRequest(recipe="transformer-tiny")
    base = launch.mpirun_argv(inv, request, interface, inv.code_dir)
    prefix = base[: base.index(inv.python)]
    hosts = ",".join(f"{n.private_ip}:{inv.gpus_per_node}" for n in inv.nodes)
    prefix[prefix.index("--hostfile"):prefix.index("--hostfile") + 2] = ["-H", hosts]
    with _head(inv) as conn:
        for argv in (prefix + ["hostname"],
                     prefix + [inv.python, f"{inv.code_dir}/bench_allreduce.py", "--mb", str(mb)]):
            print(remote.sh(conn, "timeout 300 " + shlex.join(argv)).strip())


@task(help={"dataset": "numbers (offline, default), wmt16-en-de (downloads ~1.5 GB) or imagenet (check/stage)",
            "extra": "more prepare.py arguments, quoted, e.g. \"--stage-to /opt/dlami/nvme/imagenet\"",
            "all_nodes": "run on every node (imagenet --stage-to: each node's own disk)"})
def data(c, dataset="numbers", extra="", all_nodes=False):
    """Prepare a data set on /data from the head node (prepare.py), or on every node."""
    inv = _inventory(c)
    try:
        argv = launch.prepare_argv(inv, dataset, _code_dir(c, inv), shlex.split(extra))
    except ERRORS as error:
        raise _fail(error) from None
    for node in (inv.nodes if all_nodes else [inv.head]):
        with remote.connect(inv, node) as conn:
            result = conn.run(shlex.join(argv), in_stream=False, warn=True)
        if result.exited != 0:
            raise Exit(f"error: prepare.py {dataset} failed on {node.name} (exit {result.exited})", code=1)


def _code_dir(c, inv: Inventory) -> str:
    """The synced copy on /data when `fab sync` made one, else the image's (or checkout's) program."""
    with _head(inv) as conn:
        synced = f"{inv.data_dir}/code/train"
        if remote.sh(conn, f"test -f {shlex.quote(synced + '/train.py')} && echo yes || true").strip():
            return synced
    return inv.code_dir


@task(help={"source": "local directory with train.py (default assets/train)"})
def sync(c, source="assets/train"):
    """Copy the training program (or your own directory) to /data/code/train; train then uses it."""
    inv = _inventory(c)
    src = Path(source)
    if not (src / "train.py").is_file():
        raise Exit(f"error: --source {source!r} has no train.py", code=1)
    target = f"{inv.data_dir}/code/train"
    with _head(inv) as conn:
        remote.sh(conn, f"mkdir -p {shlex.quote(target)}")
        files = [p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
        for path in files:
            rel = path.relative_to(src).as_posix()
            remote.sh(conn, f"mkdir -p {shlex.quote(str(Path(target, rel).parent))}")
            conn.put(str(path), f"{target}/{rel}")
    print(f"synced {len(files)} file(s) to {target}")


@task(help={"recipe": "transformer-tiny (fabric.yaml default) or transformer-base",
            "run": "run name (default: the recipe); the same name resumes that run",
            "steps": "max steps", "batch_per_gpu": "batch per GPU (per slot locally)",
            "precision": "fp32, fp16 or bf16", "grad_compression": "none, fp16, bf16 or powersgd",
            "nodes": "use the first K nodes", "dataset": "data set under /data/datasets",
            "follow": "stream the log until the run ends", "extra": "more train.py arguments, quoted",
            "stall_minutes": "watchdog: end the run after this long without progress (fabric.yaml: 10)",
            "master_port": "torch.distributed rendezvous port on the head node (fabric.yaml: 29500)",
            "then_stop": "stop the cluster's instances as soon as the run ends (fab start brings them back)"})
def train(c, recipe=None, run=None, steps=None, batch_per_gpu=None, precision=None,
          grad_compression=None, nodes=None, dataset=None, follow=False, extra="", stall_minutes=None,
          master_port=None, then_stop=False):
    """Start mpirun across the nodes, detached on the head node, with a watchdog."""
    inv = _inventory(c)
    settings = _settings(c)
    request = launch.TrainRequest(
        recipe=recipe or settings["recipe"], run=run, steps=int(steps) if steps else None,
        batch_per_gpu=int(batch_per_gpu) if batch_per_gpu else None, precision=precision,
        grad_compression=grad_compression, nodes=int(nodes) if nodes else None, dataset=dataset,
        stall_minutes=float(stall_minutes or settings["stall_minutes"]),
        master_port=int(master_port or settings["master_port"]), then_stop=then_stop,
        extra_args=tuple(shlex.split(extra)))
    try:
        request.validate()
        code_dir = _code_dir(c, inv)
        with _head(inv) as conn:
            rdir, log_offset = remote.start_training(conn, inv, request, code_dir)
            print(f"started {request.run_name} in {rdir} on {len(inv.select(request.nodes))} node(s) "
                  f"({code_dir})")
            if follow:
                _follow(conn, rdir, log_offset, _projector(inv))
    except ERRORS as error:
        raise _fail(error) from None


def _projector(inv: Inventory):
    """On AWS: print once what the run will cost, as soon as its step time is known."""
    if inv.source != "aws":
        return None
    price = costs.instance_price(None, inv.instance_type, inv.region or "us-east-1").usd_per_hour * len(inv.nodes)
    printed = []

    def on_progress(progress: dict) -> None:
        line = not printed and costs.projection(progress, price)
        if line:
            print(f"cost: {line}", flush=True)
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
    inv = _inventory(c)
    with _head(inv) as conn:
        rdir = _run_dir(conn, inv, run)
        if follow:
            _follow(conn, rdir)
        else:
            remote.follow_log(conn, rdir, follow=False)


@task(help={"run": "run name (default: the active run)", "force": "kill instead of checkpoint-and-exit"})
def stop(c, run=None, force=False):
    """Stop a run gracefully: checkpoint at the next step, then exit (`--force` kills it)."""
    inv = _inventory(c)
    try:
        with _head(inv) as conn:
            rdir = launch.run_dir(inv, run) if run else remote.active_run(conn, inv)
            if not rdir:
                raise remote.RemoteError("no run is going")
            if force:
                remote.force_stop(conn, inv, rdir)
                print(f"killed {rdir}")
            else:
                result = remote.request_stop(conn, rdir)
                print(f"stopped {rdir}: {result.get('state')} {result.get('reason', '')}")
    except ERRORS as error:
        raise _fail(error) from None


@task(help={"port": "local port (default 6006)"})
def tensorboard(c, port=6006):
    """TensorBoard on the head node (started if needed), through an SSH tunnel: nothing opened."""
    inv = _inventory(c)
    with _head(inv) as conn:
        try:
            remote.ensure_tensorboard(conn, inv)
        except ERRORS as error:
            raise _fail(error) from None
        with conn.forward_local(int(port), remote_port=6006, remote_host="127.0.0.1"):
            print(f"TensorBoard: http://localhost:{port} (Ctrl-C to close the tunnel)")
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass


@task(help={"interval": "seconds per sample (default 2)", "count": "samples (default: until Ctrl-C)"})
def monitor(c, interval=2.0, count=0):
    """GPU utilisation, network rx/tx (Mbit/s) and load per node, sampled live."""
    inv = _inventory(c)
    interval, count = float(interval), int(count)

    taken = 0
    while count == 0 or taken < count:
        rows = remote.on_all(inv, inv.nodes, lambda conn, node: remote.sample_node(conn, node, interval))
        print(time.strftime("%H:%M:%S"))
        print(report.table(rows, ["node", "gpu_util", "rx_mbit", "tx_mbit", "load", "error"]))
        taken += 1


@task(help={"run": "run name (default: the latest)", "dest": "local directory (default ./runs)"})
def fetch(c, run=None, dest="runs"):
    """Checkpoint, config, vocabulary, summary.json and eval texts into ./runs/NAME/."""
    inv = _inventory(c)
    with _head(inv) as conn:
        rdir = _run_dir(conn, inv, run)
        target = Path(dest) / Path(rdir).name
        files = remote.fetch_run(conn, rdir, target)
    print(f"fetched {len(files)} file(s) into {target}/")


@task(positional=["node"], help={"node": "rank of the node (default 0, the head)"})
def ssh(c, node=0):
    """An interactive shell in a node's training container."""
    inv = _inventory(c)
    target = inv.nodes[int(node)] if 0 <= int(node) < len(inv.nodes) else None
    if target is None:
        raise Exit(f"error: --node {node}: the cluster has nodes 0-{len(inv.nodes) - 1}", code=1)
    os.execvp("ssh", ["ssh", "-i", inv.ssh.key_file, "-p", str(inv.ssh.port),
                      "-o", f"UserKnownHostsFile={inv.ssh.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                      "-o", "IdentitiesOnly=yes", f"{inv.ssh.user}@{target.public_ip}"])


@task(name="up", help={"nodes": "node count (default 2)", "link": "cap each link, e.g. 1gbit",
                       "slots": "ranks per node (default 1)", "name": "cluster name (default local)",
                       "subnet": "node addresses (default 10.213.0.0/24)"})
def local_up(c, nodes=2, link=None, slots=1, name="local", subnet="10.213.0.0/24"):
    """Start an emulated cluster on this machine (root): namespaces, sshd on 4444, shared /data."""
    spec = localcluster.LocalSpec(name=name, nodes=int(nodes), slots=int(slots), link=link, subnet=subnet)
    started = time.perf_counter()
    try:
        inv = localcluster.up(spec, _inventory_path(c))
    except ERRORS as error:
        raise _fail(error) from None
    print(f"local cluster {name}: {len(inv.nodes)} node(s) "
          f"{', '.join(n.private_ip for n in inv.nodes)} up in {time.perf_counter() - started:.2f} s"
          + (f", links capped at {link}" if link else ""))


@task(name="down", help={"name": "cluster name (default local)"})
def local_down(c, name="local"):
    """Stop the emulated cluster: no namespace, bridge, process or mount is left behind."""
    try:
        removed = localcluster.down(name, _inventory_path(c))
    except ERRORS as error:
        raise _fail(error) from None
    print(f"local cluster {name} down ({len(removed)} namespace(s)/bridge removed)")


local = Collection("local", local_up, local_down)
ns = Collection(preflight, cost, audit, start, inventory, status, check, data, sync, train, logs, stop, tensorboard,
                monitor, fetch, ssh, local)
