"""Tasks on training runs: train, logs, stop, fetch."""

from __future__ import annotations

import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Optional

import paramiko
from invoke.exceptions import Exit, ThreadException

from cluster_node.protocol import rundir
from cluster_node.protocol.spec import Limits
from cluster_node.supervisor import restart_plan
from clusterops import terminal
from clusterops.inventory import Inventory
from clusterops.nodes import records as noderecords
from clusterops.nodes import remote
from clusterops.run import launch, lifecycle, meter, trainlaunch
from train import catalog

from .common import (
    DEFAULTS,
    ctrl_c_ends,
    head,
    load_inventory,
    number,
    progress,
    run_dir,
    settings,
    task,
    whole_number,
)

_STALL, _START, _PORT = (DEFAULTS[name] for name in ("stall_minutes", "start_minutes", "master_port"))
_HANG, _MARGIN = launch.TrainRequest.hang_seconds, launch.TrainRequest.budget_margin


@task(
    auto_shortflags=False,  # no -h: help must stay help
    help={
        "recipe": f"one of {', '.join(catalog.RECIPES)} (fabric.yaml default: transformer-tiny)",
        "run": "run name (default: the recipe); the same name resumes that run",
        "steps": "max steps",
        "batch_per_gpu": "batch per GPU (per slot locally)",
        "precision": catalog.either(catalog.PRECISIONS),
        "grad_compression": catalog.either(catalog.COMPRESSIONS) + " (auto: what `fab report`'s model finds fastest)",
        "nodes": "use the first K nodes (of those not excluded)",
        "exclude": "leave these nodes out: ranks or names, comma-separated (e.g. 1,2 or node1)",
        "dataset": "data set under /data/datasets",
        "data": "train from this folder on every node instead, e.g. the copy `fab data --dataset imagenet --extra "
        '"--stage-to /opt/dlami/nvme/imagenet" --all-nodes` put on each node\'s NVMe',
        "follow": "stream the log until the run ends",
        "extra": "more train.py arguments, quoted",
        "stall_minutes": f"watchdog: end the run after this long without progress (fabric.yaml: {_STALL:g})",
        "start_minutes": f"watchdog: end the run if no step comes this long after the start (default {_START:g})",
        "master_port": f"torch.distributed rendezvous port on the head node (fabric.yaml: {_PORT})",
        "then_stop": "stop the cluster's instances as soon as the run ends (fab start brings them back)",
        "max_restarts": "after a rank dies or hangs: probe the nodes, drop bad ones, resume on the rest "
        f"(default {launch.TrainRequest.max_restarts})",
        "min_nodes": f"with --max-restarts: give up when fewer healthy nodes remain (default {Limits.min_nodes})",
        "hang_seconds": f"a hang: no step on any rank for max({Limits.hang_factor:g} x step time, this) seconds, "
        f"at most --stall-minutes (default {Limits.hang_floor:g})",
        "allow_tcp": "on an EFA cluster: train even where `fab check` found NCCL on sockets (no plugin forced)",
        "budget_usd": "end the run gracefully (checkpoint) when its spend reaches this many dollars, then stop "
        "the nodes; refuse to start when `fab plan` predicts more (a resumed run keeps its budget and spend)",
        "budget_margin": "with --budget-usd: refuse only above budget x (1 + this) "
        f"(default {_MARGIN:g}: fab plan's {_MARGIN:.0%})",
        "keep_nodes": "with --budget-usd: leave the nodes up when the run ends (a budget implies --then-stop)",
    },
)
def train(
    c, recipe=None, run=None, steps=None, batch_per_gpu=None, precision=None, grad_compression=None, nodes=None,
    exclude=None, dataset=None, data=None, follow=False, extra="", stall_minutes=None, start_minutes=None,
    master_port=None, then_stop=False, max_restarts=None, min_nodes=None, hang_seconds=None, allow_tcp=False,
    budget_usd=None, budget_margin=None, keep_nodes=False,
):  # fmt: skip
    """Start a run across the nodes, supervised on the head node.

    Start mpirun across the nodes, detached on the head node, with a watchdog."""
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
        data=data,
        stall_minutes=number(stall_minutes or defaults["stall_minutes"], "--stall-minutes"),
        start_minutes=number(start_minutes or defaults["start_minutes"], "--start-minutes"),
        master_port=whole_number(master_port or defaults["master_port"], "--master-port"),
        then_stop=then_stop,
        max_restarts=whole_number(max_restarts, "--max-restarts") or 0,
        min_nodes=whole_number(min_nodes, "--min-nodes"),
        hang_seconds=_HANG if hang_seconds is None else number(hang_seconds, "--hang-seconds"),
        allow_tcp=allow_tcp,
        budget_usd=None if budget_usd is None else number(budget_usd, "--budget-usd"),
        budget_margin=_MARGIN if budget_margin is None else number(budget_margin, "--budget-margin"),
        keep_nodes=keep_nodes,
        extra_args=_split(extra),
    )
    request.validate()
    flags = dict(recipe=recipe, max_restarts=max_restarts, min_nodes=min_nodes, hang_seconds=hang_seconds)
    flags.update(stall_minutes=stall_minutes, start_minutes=start_minutes, master_port=master_port)
    given = {name for name, value in flags.items() if value is not None}
    started = trainlaunch.start(inv, request, given, say=print)
    print(started.line)
    if started.note:
        print(f"note: {started.note}")
    if follow:
        with head(inv) as conn:
            _follow(conn, inv, started.run_dir, started.log_offset, meter.projector(inv), node=inv.head.name)


def _split(extra: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(extra))
    except ValueError as error:  # an unclosed quote
        raise Exit(f"error: invalid --extra {extra!r}: {error}", code=1) from None


# A dropped SSH connection reaches the follower as one of these (paramiko raises SSHException or the
# socket's OSError, EOFError at a half-read packet; invoke wraps an IO thread's failure).
CONNECTION_LOST = (paramiko.SSHException, OSError, EOFError, ThreadException, remote.RemoteError)
# paramiko's transport thread also logs the socket error (with no handler: to stderr); the
# exception above says it once.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


def _follow(conn, inv: Inventory, rdir: str, offset: int = 0, on_progress=None, node: str = "the head node") -> None:
    seen: list[Optional[rundir.RunStatus]] = [None]  # the last status read, kept if a read after it fails
    read: list[noderecords.RunFiles] = []  # the run's state, once read

    def keep(status: Optional[rundir.RunStatus]) -> None:
        seen[0] = status

    stopped = f"stopped following {rdir}; the run goes on (on AWS, billed): "
    stopped += "`fab logs --follow` re-attaches, `fab stop` ends it"
    try:
        with ctrl_c_ends(stopped, code=130):  # 128 + SIGINT, as a shell reports a Ctrl-C
            state, status_ = lifecycle.follow_to_end(conn, inv, rdir, offset, on_progress, keep, read.append)
    except CONNECTION_LOST as error:
        stopping = bool(seen[0] and seen[0].then_stop == "stopping")
        if isinstance(error, remote.RemoteError) and conn.is_connected and not stopping:
            raise  # the node answered: a real error of the run's files (a stopping head cuts commands off)
        if not stopping:
            detail = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no detail'}"
            raise Exit(
                f"error: lost the connection to {node} ({conn.host}) while following {rdir} ({detail}); "
                "the run goes on: `fab logs --follow` picks it up again (`fab status` first)",
                code=1,
            ) from None
        # The run ended and --then-stop is taking the head node down under these reads: as expected.
        status_ = seen[0]
        state = read[0] if read else noderecords.RunFiles(run=rdir, status=status_)
    except KeyboardInterrupt:  # off the main thread (no handler there): Invoke would exit 1 without a word
        raise Exit(stopped, code=130) from None
    _print_end(rdir, state, status_)


def _print_end(rdir: str, state: noderecords.RunFiles, status_: Optional[rundir.RunStatus]) -> None:
    """The run's last line and summary, what --then-stop did; exit 1 if the run or the stop failed."""
    print(terminal.run_line(rdir, state))
    history = restart_plan.history_lines([restart.to_json() for restart in state.restarts])
    for line in terminal.summary_lines(state.summary) + history:
        print(line)
    if status_ and status_.resume:  # a Spot notice ended it: the checkpoint is on /data
        print(f"resume with: {status_.resume}")
    stop_line, stop_failed = terminal.then_stop_line(status_), bool(status_ and status_.then_stop == "failed")
    if stop_line:  # a failed stop leaves the cluster billing: on stderr, and exit 1
        print(stop_line, file=sys.stderr if stop_failed else sys.stdout, flush=True)
    if status_ is None or status_.state not in (rundir.RunState.FINISHED, rundir.RunState.STOPPED):
        raise Exit(f"error: run {status_ and status_.state}: {status_ and status_.reason}", code=1)
    if stop_failed:
        raise Exit(code=1)


@task(
    help={"run": "run name (default: the active or latest run)", "follow": "keep streaming"},
)
def logs(c, run=None, follow=False):
    """Print a run's log; --follow streams it until the run ends.

    Print a run's log (train.log on /data); --follow streams it until the run ends."""
    inv = load_inventory(c)
    with head(inv) as conn:
        rdir = run_dir(conn, inv, run)
        if follow:
            _follow(conn, inv, rdir, node=inv.head.name)
        elif (ended := lifecycle.follow_log(conn, inv, rdir, follow=False)) and ended.state == rundir.RunState.STOPPED:
            print(f"run {rdir}: stopped (resumable: {terminal.resume_hint(rdir)})")


@task(
    help={
        "run": "run name (default: the active run)",
        "force": "kill instead of checkpoint-and-exit",
    },
)
def stop(c, run=None, force=False):
    """Stop a run at its next step, with a checkpoint (--force kills it).

    Stop a run gracefully: checkpoint at the next step, then exit (`--force` kills it). The nodes stay up (on AWS,
    billed) until the idle watchdog stops them, unless the run has --then-stop: `fab stop-cluster` stops them now."""
    inv = load_inventory(c)
    with head(inv) as conn:
        rdir = run_dir(conn, inv, run) if run else lifecycle.active_run(conn, inv)
        if not rdir:
            raise remote.RemoteError("no run is going")
        result = None
        if force:
            lifecycle.force_stop(conn, inv, rdir)
            print(f"killed {rdir}")
        else:
            progress(f"stop: asked {rdir} to checkpoint at its next step (no eval) and end; waiting (up to 120 s) ...")
            result = lifecycle.request_stop(conn, inv, rdir, say=progress)
            if result.state == rundir.RunState.STOPPED:
                print(f"stopped {rdir}: {result.reason}; resumable: {terminal.resume_hint(rdir)}")
            else:  # it ended on its own meanwhile
                print(f"{rdir} ended: {result.state} {result.reason}")
        nodes = terminal.after_stop_line(inv, result)
        if nodes:
            print(nodes)


@task(
    help={"run": "run name (default: the latest)", "dest": "local directory (default ./runs)"},
)
def fetch(c, run=None, dest="runs"):
    """Bring a run's checkpoint, summary, evals and report to ./runs/NAME.

    Checkpoint, config, vocabulary, summary.json, eval texts and `fab report`'s report into ./runs/NAME/."""
    inv = load_inventory(c)
    with head(inv) as conn:
        rdir = run_dir(conn, inv, run)
        target = Path(dest) / Path(rdir).name
        files, previous = lifecycle.fetch_run(conn, inv, rdir, target)
    print(
        f"fetched {len(files)} file(s) into {target}/" + (f" (the earlier copy is now {previous}/)" if previous else "")
    )
    print(checkpoint_line(files, target))


def checkpoint_line(files: list[Path], target: Path) -> str:
    """Which checkpoint came, or why none did (a run younger than its first checkpoint)."""
    chosen = [f for f in files if f.suffix == ".pt"]
    if chosen:
        return f"checkpoint: {chosen[0].relative_to(target)}"
    config = read_local_json(target / rundir.CONFIG)
    every = config.get("checkpoint_every")
    return (
        "no checkpoint yet"
        + (f": the run writes one every {every} steps" if every else "")
        + (" (`fab stop` checkpoints at the next step)")
    )


def read_local_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
