"""`fab train`'s use case: start(inventory, request, given) -> Started. It resumes a run that exists
(clusterops.run.resume), checks the nodes (the quick probe; the transport `fab check` found), prices a --budget-usd
(clusterops.run.meter, clusterops.run.budget: refused when `fab plan`'s prediction is over it) and starts the
supervisor on the head node (lifecycle.start_training)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from clusterops.inventory import Inventory
from clusterops.nodes import health, remote
from clusterops.nodes import probe as nodeprobe
from clusterops.nodes import view as nodeview
from clusterops.predict import plan as planning
from clusterops.run import analysis, launch, lifecycle, resume
from clusterops.run import budget as budgets
from clusterops.run.meter import billed_nodes, budget_price, efs_io_rate

Say = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Started:
    """A run the supervisor started: where, the log's size before it (where its output starts), how (a new
    run or a resumed one), on how many nodes, from which program directory, and a note (a close run name)."""

    run_dir: str
    log_offset: int
    how: str
    nodes: int
    code_dir: str
    note: str = ""

    @property
    def line(self) -> str:
        return f"{self.how} in {self.run_dir} on {self.nodes} node(s) ({self.code_dir})"


def start(inv: Inventory, request: launch.TrainRequest, given: set[str], say: Say = print) -> Started:
    """`fab train`'s use case. A run that exists resumes with its saved settings (`given`: the flags typed,
    which may differ); the trainer's flags are checked with its own parser before anything starts; decided
    once, on one connection to the head node. `say`: the warnings and the budget's line, as they come."""
    selected = inv.select(request.nodes, request.exclude)  # the one selection: a bad one is refused before connecting
    with remote.connect(inv, inv.head) as conn:
        return _start(conn, inv, request, given, selected, say)


def _start(conn, inv: Inventory, request: launch.TrainRequest, given: set[str], selected, say: Say) -> Started:
    saved = resume.saved(conn, inv, request.run_name)
    request = resume.resumed(request, given, saved, inv) if saved else request
    kept = ""
    if saved:  # on another number of ranks: the same global batch (lr, samples, steps left), or refused
        ranks, gpus = len(selected) * inv.gpus_per_node, inv.gpus_per_node
        request, kept = resume.keep_global_batch(request, saved, ranks, gpus, len(inv.nodes))
    config = resume.check_trainer(inv, request, saved, len(selected))  # one line on a bad flag; run untouched
    taken = resume.run_names(conn, inv)
    if saved:  # a finished run is never rewritten by a launch that trains nothing
        resume.refuse_finished(request, saved, config.max_steps, taken)
    nodes = launch.check_nodes(inv, request, selected)  # --min-nodes may be the saved run's; the plan below
    plan = _plan(conn, inv, request, nodes, _refuse_bad_nodes(inv, nodes, say))
    plan = _budgeted(conn, inv, plan, saved, budgets.trained(config), say)
    rdir, log_offset = lifecycle.start_training(conn, inv, plan)
    how = f"resumed {request.run_name} with its saved settings" if saved else resume.new_run_line(request)
    how += f", {kept}" if kept else ""
    note = resume.close_run(request.run_name, taken) if not saved else ""  # a typo in --run starts a new run
    return Started(rdir, log_offset, how, len(plan.nodes), plan.code_dir, note or "")


def _plan(conn, inv: Inventory, request: launch.TrainRequest, nodes, verdicts) -> launch.LaunchPlan:
    """The launch decided once, on one connection to the head node: where the program is, that the
    transport `fab check` found is fit (unless --allow-tcp), the head node's interface."""
    if not request.allow_tcp:
        _refuse_tcp(conn, inv, nodes)
    interface = nodeview.detect_interface(conn, inv.head)
    return launch.LaunchPlan(request, tuple(nodes), interface, lifecycle.code_dir_on(conn, inv), tuple(verdicts))


def _budgeted(
    conn, inv: Inventory, plan: launch.LaunchPlan, saved, trains: budgets.Trains, say: Say = print
) -> launch.LaunchPlan:
    """--budget-usd (or a resumed run's saved one): priced as `fab cost` prices the nodes (the price `fab
    inventory` kept; on a Spot cluster the most a node-hour can cost: budget_price) over every node of the
    cluster that bills (on AWS the meter asks EC2 which at every reading), and EFS I/O, on top of
    what the run spent before; refused before anything is written when the run already spent it, or when
    `fab plan`, from the latest measured run, predicts more than is left of it and its margin. `trains`: what
    the run trains, as the trainer will have it (budget.trained)."""
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
    steps, what = budgets.steps_to_run(trains.steps, saved)
    estimate, why = _prediction(conn, inv, plan, trains._replace(steps=steps), price, nodes)
    refused = budgets.refusal(estimate, steps, request.budget_usd, request.budget_margin, spent)
    if refused:
        raise budgets.BudgetError(refused)
    predicted = (
        f"fab plan predicts ${estimate.usd_total or 0:,.2f} for {what}"
        if estimate
        else f"no prediction ({why}): metered on the head node as the run goes"
    )
    say(budgets.budget_line(request, budget, predicted))
    return dataclasses.replace(plan, budget=budget)


def _prediction(conn, inv: Inventory, plan: launch.LaunchPlan, trains: budgets.Trains, price, billed: int) -> tuple:
    """fab plan's estimate for this launch (`trains`: its steps to train, each rank's batch, its recipe) from
    the run of that name, else the run launched last, if it trained the same recipe, priced over every node
    of the cluster; (None, why) when neither gives one."""
    why = "no finished run with a step breakdown"
    for base in dict.fromkeys([launch.run_dir(inv, plan.request.run_name), lifecycle.latest_run(conn, inv)]):
        if not base:
            continue
        try:
            inputs = analysis.plan_inputs(conn, inv, base)
            measured = inputs.get("summary")
            if measured is not None and measured.recipe and measured.recipe != trains.recipe:
                raise planning.PlanError(
                    f"run {base.rsplit('/', 1)[-1]} trained {measured.recipe}, not {trains.recipe}"
                )
            on_aws, nodes = inv.source == "aws", len(plan.nodes)
            estimate = budgets.prediction(
                inputs,
                inv.instance_type,
                on_aws,
                nodes,
                trains.steps,
                price.usd_per_hour,
                price.source,
                inv.gpus_per_node,
                trains.per_rank,
            )
            if estimate.usd_total is None:
                raise planning.PlanError(estimate.refused or "the prices are unknown")
            return budgets.billed(estimate, billed), ""
        except planning.PlanError as error:
            why = str(error)
    return None, why


def _refuse_bad_nodes(inv: Inventory, nodes, say: Say = print) -> list:
    """The quick health check (reachable, /data writable, versions, GPUs): one line naming a bad node
    and how to train without it; degraded nodes are a warning."""
    verdicts = nodeprobe.quick(inv, nodes)
    for verdict in verdicts:
        if verdict.verdict == "bad":
            rank = next(n.rank for n in nodes if n.name == verdict.node)
            raise launch.LaunchError(
                f"{verdict.node} is bad ({'; '.join(verdict.reasons)}): fix it, or train without it "
                f"with `fab train --exclude {rank}`"
            )
        if verdict.verdict == "degraded":
            say(f"warning: {verdict.node} is degraded: {'; '.join(verdict.reasons)}")
    return verdicts


def _refuse_tcp(conn, inv: Inventory, nodes) -> None:
    """An EFA cluster whose last `fab check` found NCCL on sockets does not train (one line; --allow-tcp)."""
    verdict = remote.read_json(conn, health.transport_file(inv))
    refusal = health.transport_refusal(verdict, [n.name for n in nodes], bool(inv.extra.get("efa_cards")))
    if refusal:
        raise launch.LaunchError(refusal.removeprefix("error: "))
