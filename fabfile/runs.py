"""Tasks on training runs: train, logs, stop, fetch."""

from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Optional

import paramiko
from invoke.exceptions import Exit, ThreadException

from cluster_node.protocol import rundir
from cluster_node.supervisor import restart_plan
from clusterops import cost as costs
from clusterops import terminal
from clusterops.inventory import Inventory
from clusterops.nodes import health, remote
from clusterops.nodes import probe as nodeprobe
from clusterops.nodes import records as noderecords
from clusterops.nodes import view as nodeview
from clusterops.predict import plan as planning
from clusterops.run import analysis, launch, lifecycle, resume
from clusterops.run import budget as budgets
from train import catalog

from .common import (
    billed_nodes,
    budget_price,
    code_dir_on,
    ctrl_c_ends,
    efs_io_rate,
    head,
    load_inventory,
    node_price,
    number,
    progress,
    run_dir,
    settings,
    task,
    whole_number,
)


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
        "budget_usd": "end the run gracefully (checkpoint) when its spend reaches this many dollars, then stop "
        "the nodes; refuse to start when `fab plan` predicts more (a resumed run keeps its budget and spend)",
        "budget_margin": "with --budget-usd: refuse only above budget x (1 + this) (default 0.2: fab plan's 20%)",
        "keep_nodes": "with --budget-usd: leave the nodes up when the run ends (a budget implies --then-stop)",
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
    budget_usd=None,
    budget_margin=None,
    keep_nodes=False,
):
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
        stall_minutes=number(stall_minutes or defaults["stall_minutes"], "--stall-minutes"),
        start_minutes=number(start_minutes or defaults["start_minutes"], "--start-minutes"),
        master_port=whole_number(master_port or defaults["master_port"], "--master-port"),
        then_stop=then_stop,
        max_restarts=whole_number(max_restarts, "--max-restarts") or 0,
        min_nodes=whole_number(min_nodes, "--min-nodes"),
        hang_seconds=60.0 if hang_seconds is None else number(hang_seconds, "--hang-seconds"),
        allow_tcp=allow_tcp,
        budget_usd=None if budget_usd is None else number(budget_usd, "--budget-usd"),
        budget_margin=budgets.DEFAULT_MARGIN if budget_margin is None else number(budget_margin, "--budget-margin"),
        keep_nodes=keep_nodes,
        extra_args=_split(extra),
    )
    request.validate()
    flags = dict(recipe=recipe, max_restarts=max_restarts, min_nodes=min_nodes, hang_seconds=hang_seconds)
    flags.update(stall_minutes=stall_minutes, start_minutes=start_minutes, master_port=master_port)
    _launch(inv, request, {name for name, value in flags.items() if value is not None}, follow)


def _launch(inv: Inventory, request: launch.TrainRequest, given: set[str], follow: bool) -> None:
    """A run that exists resumes with its saved settings (`given`: the flags typed, which may differ);
    the trainer's flags are checked with its own parser before anything starts."""
    selected = inv.select(request.nodes, request.exclude)  # the one selection: a bad one is refused before connecting
    with head(inv) as conn:
        saved = resume.saved(conn, inv, request.run_name)
        request = resume.resumed(request, given, saved, inv) if saved else request
        max_steps = resume.check_trainer(inv, request, saved)  # one line on a bad flag; the run untouched
        taken = resume.run_names(conn, inv)
        if saved:  # a finished run is never rewritten by a launch that trains nothing
            resume.refuse_finished(request, saved, max_steps, taken)
        nodes = launch.check_nodes(inv, request, selected)  # --min-nodes may be the saved run's; the plan below
        plan = _budgeted(conn, inv, _plan(conn, inv, request, nodes, _refuse_bad_nodes(inv, nodes)), saved)
        rdir, log_offset = lifecycle.start_training(conn, inv, plan)
        how = f"resumed {request.run_name} with its saved settings" if saved else resume.new_run_line(request)
        print(f"{how} in {rdir} on {len(plan.nodes)} node(s) ({plan.code_dir})")
        if not saved and resume.close_run(request.run_name, taken):  # a typo in --run starts a new run
            print(f"note: {resume.close_run(request.run_name, taken)}")
        if follow:
            _follow(conn, inv, rdir, log_offset, _projector(inv), node=inv.head.name)


def _split(extra: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(extra))
    except ValueError as error:  # an unclosed quote
        raise Exit(f"error: invalid --extra {extra!r}: {error}", code=1) from None


def _plan(conn, inv: Inventory, request: launch.TrainRequest, nodes, verdicts) -> launch.LaunchPlan:
    """The launch decided once, on one connection to the head node: where the program is, that the
    transport `fab check` found is fit (unless --allow-tcp), the head node's interface."""
    if not request.allow_tcp:
        _refuse_tcp(conn, inv, nodes)
    interface = nodeview.detect_interface(conn, inv.head)
    return launch.LaunchPlan(request, tuple(nodes), interface, code_dir_on(conn, inv), tuple(verdicts))


def _budgeted(conn, inv: Inventory, plan: launch.LaunchPlan, saved) -> launch.LaunchPlan:
    """--budget-usd (or a resumed run's saved one): priced as `fab cost` prices the nodes (the price `fab
    inventory` kept; on a Spot cluster the most a node-hour can cost: budget_price) over every node of the
    cluster that bills (on AWS the meter asks EC2 which at every reading), and EFS I/O, on top of
    what the run spent before; refused before anything is written when the run already spent it, or when
    `fab plan`, from the latest measured run, predicts more than is left of it and its margin."""
    request = plan.request
    if request.budget_usd is None:
        return plan
    price, spent = budget_price(inv), budgets.spent_before(saved)
    efs = (inv.file_system_id or "", inv.region or "") if inv.source == "aws" else ("", "")
    io_rate = efs_io_rate(inv) if efs[0] else 0.0  # no file system on AWS (the emulated cluster): no EFS bill
    tail = budgets.io_tail(saved) if efs[0] else ()  # the last segment's I/O CloudWatch had not published
    nodes = billed_nodes(inv)  # every node that bills, also those this run leaves out
    ids = tuple(n.instance_id for n in inv.nodes if n.instance_id) if inv.source == "aws" else ()
    where = (nodes, spent, *efs, tail, ids, inv.source == "local")  # the emulated cluster bills nothing: said so
    budget = budgets.run_budget(request.budget_usd, price.usd_per_hour, price.source, io_rate, *where)
    steps, what = budgets.steps_to_run(request, saved)
    estimate, why = _prediction(conn, inv, plan, steps, price, nodes)
    refused = budgets.refusal(estimate, steps, request.budget_usd, request.budget_margin, spent)
    if refused:
        raise budgets.BudgetError(refused)
    predicted = (
        f"fab plan predicts ${estimate.usd_total or 0:,.2f} for {what}"
        if estimate
        else f"no prediction ({why}): metered on the head node as the run goes"
    )
    print(budgets.budget_line(request, budget, predicted))
    return dataclasses.replace(plan, budget=budget)


def _prediction(conn, inv: Inventory, plan: launch.LaunchPlan, steps: int, price, billed: int) -> tuple:
    """fab plan's estimate for this launch from the run of that name, else the latest measured run, priced
    over every node of the cluster; (None, why) when neither gives one."""
    why = "no finished run with a step breakdown"
    for base in dict.fromkeys([launch.run_dir(inv, plan.request.run_name), lifecycle.latest_run(conn, inv)]):
        if not base:
            continue
        try:
            inputs = analysis.plan_inputs(conn, inv, base)
            on_aws, nodes = inv.source == "aws", len(plan.nodes)
            estimate = budgets.prediction(
                inputs, inv.instance_type, on_aws, nodes, steps, price.usd_per_hour, price.source, inv.gpus_per_node
            )
            if estimate.usd_total is None:
                raise planning.PlanError(estimate.refused or "the prices are unknown")
            return budgets.billed(estimate, billed), ""
        except planning.PlanError as error:
            why = str(error)
    return None, why


def _refuse_bad_nodes(inv: Inventory, nodes) -> list:
    """The quick health check (reachable, /data writable, versions, GPUs): one line naming a bad node
    and how to train without it; degraded nodes are a warning."""
    verdicts = nodeprobe.quick(inv, nodes)
    for verdict in verdicts:
        if verdict.verdict == "bad":
            rank = next(n.rank for n in nodes if n.name == verdict.node)
            raise Exit(
                f"error: {verdict.node} is bad ({'; '.join(verdict.reasons)}): fix it, or train without it "
                f"with `fab train --exclude {rank}`",
                code=1,
            )
        if verdict.verdict == "degraded":
            print(f"warning: {verdict.node} is degraded: {'; '.join(verdict.reasons)}")
    return verdicts


def _refuse_tcp(conn, inv: Inventory, nodes) -> None:
    """An EFA cluster whose last `fab check` found NCCL on sockets does not train (one line; --allow-tcp)."""
    verdict = remote.read_json(conn, health.transport_file(inv))
    refusal = health.transport_refusal(verdict, [n.name for n in nodes], bool(inv.extra.get("efa_cards")))
    if refusal:
        raise Exit(refusal, code=1)


def _projector(inv: Inventory):
    """On AWS: print once what the run will cost (nodes and EFS I/O), as soon as its step time is
    known; "unknown" where no price is known, never an exception after the run has started."""
    if inv.source != "aws":
        return None
    price = node_price(inv)
    hourly = None if price.usd_per_hour is None else price.usd_per_hour * len(inv.nodes)
    printed: list[str] = []

    def on_progress(progress: Optional[rundir.Progress]) -> None:
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


def _follow(conn, inv: Inventory, rdir: str, offset: int = 0, on_progress=None, node: str = "the head node") -> None:
    seen: list[Optional[rundir.RunStatus]] = [None]  # the last status read, kept if a read after it fails
    state: Optional[noderecords.RunFiles] = None

    def keep(status: Optional[rundir.RunStatus]) -> None:
        seen[0] = status

    stopped = f"stopped following {rdir}; the run goes on (on AWS, billed): "
    stopped += "`fab logs --follow` re-attaches, `fab stop` ends it"
    try:
        with ctrl_c_ends(stopped, code=130):  # 128 + SIGINT, as a shell reports a Ctrl-C
            status_ = lifecycle.follow_log(conn, inv, rdir, offset=offset, on_progress=on_progress, on_status=keep)
            state = lifecycle.run_state(conn, inv, rdir)
            status_ = lifecycle.then_stop_outcome(conn, inv, rdir, state.status or status_)
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
        state = state or noderecords.RunFiles(run=rdir, status=status_)
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

    Stop a run gracefully: checkpoint at the next step, then exit (`--force` kills it)."""
    inv = load_inventory(c)
    with head(inv) as conn:
        rdir = run_dir(conn, inv, run) if run else lifecycle.active_run(conn, inv)
        if not rdir:
            raise remote.RemoteError("no run is going")
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
