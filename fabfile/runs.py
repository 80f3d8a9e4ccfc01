"""Tasks on training runs: train, logs, stop, fetch."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import paramiko
from fabric import task
from invoke.exceptions import Exit, ThreadException

from cluster_node import restart_plan
from clusterops import cost as costs
from clusterops import health, launch, remote, report
from clusterops.inventory import Inventory

from .aws import efs_io_rate, kept_price
from .common import ERRORS, fail, head, load_inventory, number, run_dir, settings, training_code_dir, whole_number


@task(
    auto_shortflags=False,  # no -h: help must stay help
    help={
        "recipe": f"one of {', '.join(launch.RECIPES)} (fabric.yaml default: transformer-tiny)",
        "run": "run name (default: the recipe); the same name resumes that run",
        "steps": "max steps",
        "batch_per_gpu": "batch per GPU (per slot locally)",
        "precision": "fp32, fp16 or bf16",
        "grad_compression": "none, fp16, bf16, powersgd or auto (the mode `fab report`'s model predicts fastest)",
        "nodes": "use the first K nodes (of those not excluded)",
        "exclude": "leave these nodes out: ranks or names, comma-separated (e.g. 1,2 or node1)",
        "dataset": "data set under /data/datasets",
        "follow": "stream the log until the run ends",
        "extra": "more train.py arguments, quoted",
        "stall_minutes": "watchdog: end the run after this long without progress (fabric.yaml: 10)",
        "start_minutes": "watchdog: end the run if no step comes this long after the start (default 15)",
        "master_port": "torch.distributed rendezvous port on the head node (fabric.yaml: 29500)",
        "then_stop": "stop the cluster's instances as soon as the run ends (fab start brings them back)",
        "max_restarts": "after a rank dies or hangs: probe the nodes, drop bad ones, resume on the rest (default 0)",
        "min_nodes": "with --max-restarts: give up when fewer healthy nodes remain (default 1)",
        "hang_seconds": "a hang: no step on any rank for max(20 x step time, this) seconds (default 60)",
        "allow_tcp": "on an EFA cluster: train even where `fab check` found NCCL on sockets (no plugin forced)",
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
    exclude=None,
    dataset=None,
    follow=False,
    extra="",
    stall_minutes=None,
    start_minutes=None,
    master_port=None,
    then_stop=False,
    max_restarts=None,
    min_nodes=None,
    hang_seconds=None,
    allow_tcp=False,
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
        exclude=tuple(part.strip() for part in (exclude or "").split(",") if part.strip()),
        dataset=dataset,
        stall_minutes=number(stall_minutes or defaults["stall_minutes"], "--stall-minutes"),
        start_minutes=number(start_minutes or defaults["start_minutes"], "--start-minutes"),
        master_port=whole_number(master_port or defaults["master_port"], "--master-port"),
        then_stop=then_stop,
        max_restarts=whole_number(max_restarts, "--max-restarts") or 0,
        min_nodes=whole_number(min_nodes, "--min-nodes"),
        hang_seconds=60.0 if hang_seconds is None else number(hang_seconds, "--hang-seconds"),
        allow_tcp=allow_tcp,
        extra_args=tuple(shlex.split(extra)),
    )
    try:
        request.validate()
        chosen = inv.select(request.nodes, request.exclude)
        _refuse_bad_nodes(inv, chosen)
        code_dir = training_code_dir(inv)
        with head(inv) as conn:
            if not allow_tcp:
                _refuse_tcp(conn, inv, chosen)
            rdir, log_offset = remote.start_training(conn, inv, request, code_dir)
            print(f"started {request.run_name} in {rdir} on {len(chosen)} node(s) ({code_dir})")
            if follow:
                _follow(conn, rdir, log_offset, _projector(inv), node=inv.head.name)
    except ERRORS as error:
        raise fail(error) from None


def _refuse_bad_nodes(inv: Inventory, nodes) -> None:
    """The quick health check (reachable, /data writable, versions, GPUs): one line naming a bad node
    and how to train without it; degraded nodes are a warning."""
    for verdict in health.quick(inv, nodes):
        if verdict.verdict == "bad":
            rank = next(n.rank for n in nodes if n.name == verdict.node)
            raise Exit(
                f"error: {verdict.node} is bad ({'; '.join(verdict.reasons)}): fix it, or train without it "
                f"with `fab train --exclude {rank}`",
                code=1,
            )
        if verdict.verdict == "degraded":
            print(f"warning: {verdict.node} is degraded: {'; '.join(verdict.reasons)}")


def _refuse_tcp(conn, inv: Inventory, nodes) -> None:
    """An EFA cluster whose last `fab check` found NCCL on sockets does not train (one line; --allow-tcp)."""
    verdict = remote.read_json(conn, health.transport_file(inv))
    refusal = health.transport_refusal(verdict, [n.name for n in nodes], bool(inv.extra.get("efa_cards")))
    if refusal:
        raise Exit(refusal, code=1)


def _code_dir(c, inv: Inventory) -> str:
    """The synced copy on /data when `fab sync` made one, else the image's (or checkout's) program."""
    with head(inv) as conn:
        synced = f"{inv.data_dir}/code/train"
        if remote.sh(conn, f"test -f {shlex.quote(synced + '/train.py')} && echo yes || true").strip():
            return synced
    return inv.code_dir


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


# A dropped SSH connection reaches the follower as one of these (paramiko raises SSHException or the
# socket's OSError, EOFError at a half-read packet; invoke wraps an IO thread's failure).
CONNECTION_LOST = (paramiko.SSHException, OSError, EOFError, ThreadException, remote.RemoteError)
# paramiko's transport thread also logs the socket error (with no handler: to stderr); the
# exception above says it once.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


def _follow(conn, rdir: str, offset: int = 0, on_progress=None, node: str = "the head node") -> None:
    try:
        status_ = remote.follow_log(conn, rdir, offset=offset, on_progress=on_progress)
        state = remote.run_state(conn, rdir)
    except CONNECTION_LOST as error:
        if isinstance(error, remote.RemoteError) and conn.is_connected:
            raise  # the node answered: a real error of the run's files
        detail = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no detail'}"
        raise Exit(
            f"error: lost the connection to {node} ({conn.host}) while following {rdir} ({detail}); "
            "the run goes on: `fab logs --follow` picks it up again (`fab status` first)",
            code=1,
        ) from None
    except KeyboardInterrupt:  # Invoke exits 1 without a word on it (invoke/program.py); the run goes on
        raise Exit(
            f"stopped following {rdir}; the run goes on (on AWS, billed): "
            "`fab logs --follow` re-attaches, `fab stop` ends it",
            code=130,  # 128 + SIGINT, as a shell reports a Ctrl-C
        ) from None
    print(report.run_line(rdir, state))
    for line in report.summary_lines(state["summary"]) + restart_plan.history_lines(state["restarts"]):
        print(line)
    if status_.get("resume"):  # a Spot notice ended it: the checkpoint is on /data
        print(f"resume with: {status_['resume']}")
    if status_.get("state") != "finished":
        raise Exit(f"error: run {status_.get('state')}: {status_.get('reason')}", code=1)


@task(help={"run": "run name (default: the active or latest run)", "follow": "keep streaming"})
def logs(c, run=None, follow=False):
    """Print a run's log (train.log on /data); --follow streams it until the run ends."""
    inv = load_inventory(c)
    try:
        with head(inv) as conn:
            rdir = run_dir(conn, inv, run)
            if follow:
                _follow(conn, rdir, node=inv.head.name)
            else:
                remote.follow_log(conn, rdir, follow=False)
    except ERRORS as error:
        raise fail(error) from None


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


@task(help={"run": "run name (default: the latest)", "dest": "local directory (default ./runs)"})
def fetch(c, run=None, dest="runs"):
    """Checkpoint, config, vocabulary, summary.json, eval texts and `fab report`'s report into ./runs/NAME/."""
    inv = load_inventory(c)
    with head(inv) as conn:
        rdir = run_dir(conn, inv, run)
        target = Path(dest) / Path(rdir).name
        files, previous = remote.fetch_run(conn, rdir, target)
    print(
        f"fetched {len(files)} file(s) into {target}/" + (f" (the earlier copy is now {previous}/)" if previous else "")
    )
