"""`fab plan`'s use case: plan(connection, inventory, run_dir, run, query) -> Planned. The base (a measured run's
step breakdown, or a step time given), the target (steps, a metric the run's eval curve reached, or the run's
own --steps), an offer per instance type (its GPU, ranks per node, price: the one `fab inventory` kept, the
offline table's, or the Spot price in effect), then clusterops.predict.plan's estimates for N = 1..max_nodes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from clusterops import cost as costs
from clusterops.aws.session import aws_session
from clusterops.inventory import Inventory
from clusterops.predict import plan as planning
from clusterops.run import analysis
from clusterops.run import budget as budgets
from clusterops.run.meter import kept_price
from stacks.instance_types import lookup


@dataclass(frozen=True)
class Query:
    """What `fab plan` was asked, parsed: the instance types, the target, the base when no run gives it."""

    types: tuple[str, ...]
    steps: Optional[int] = None
    metric: Optional[str] = None
    step_s: Optional[float] = None  # plan from this step time instead of a run
    grad_mb: float = 0.0
    max_nodes: int = 4
    deadline_h: Optional[float] = None
    spot: bool = False
    link_gbit: Optional[float] = None
    root_gb: float = planning.Storage.root_gb
    efs_gb: float = 0.0
    read_gb: float = 0.0


@dataclass(frozen=True)
class Planned:
    """The plan: its base, target, offers, the table's rows, the cheapest estimate within the deadline and,
    when none is priced or in time, the fastest (None: no estimate has a time)."""

    base: planning.Base
    target: int
    target_model: str
    offers: list[planning.Offer]
    rows: list[dict]
    best: Optional[planning.Estimate]
    fastest: Optional[planning.Estimate]
    intervals: planning.Intervals = planning.Intervals()

    def node_loss(self, estimate: planning.Estimate) -> str:
        return planning.node_loss(estimate, self.intervals)


def plan(connection, inv: Inventory, run_dir: Optional[str], run: Optional[str], query: Query) -> Planned:
    """The estimates for `query`, from the run in `run_dir` (None: from query.step_s alone)."""
    inputs = analysis.plan_inputs(connection, inv, run_dir) if run_dir else {}
    base = _plan_base(inv, inputs, query.step_s, query.grad_mb, query.types[0], run)
    target, target_model = _plan_target(inputs, query.steps, query.metric)
    offers = [_offer(inv, name, base, query.link_gbit, query.spot) for name in query.types]
    write_gb = budgets.checkpoint_gb(inputs.get("summary"), inputs.get("config") or {}, target)
    storage = planning.Storage(query.root_gb, query.efs_gb, query.read_gb, write_gb)
    estimates = planning.plan(base, offers, query.max_nodes, target, storage)
    timed = [e for e in estimates if e.hours is not None]
    best = planning.cheapest(estimates, query.deadline_h)
    fastest = min(timed, key=lambda e: e.hours or 0.0) if timed and best is None else None
    rows = planning.table_rows(estimates, query.deadline_h)
    return Planned(base, target, target_model, offers, rows, best, fastest, _intervals(inputs.get("config") or {}))


def _intervals(config: dict) -> planning.Intervals:
    """The base run's snapshot and checkpoint intervals (config.json); the trainer's defaults without one."""
    default = planning.Intervals()
    return planning.Intervals(
        float(config.get("snapshot_seconds", default.snapshot_s)),
        config.get("checkpoint_every"),
        float(config.get("checkpoint_minutes", default.checkpoint_min)),
    )


def _plan_base(inv, inputs, step_s, grad_mb, first_type, run):
    if step_s is not None:
        gpu = _gpu(inv, first_type)
        return planning.base_from_step(step_s, grad_mb, gpu, first_type)
    slots = inv.gpus_per_node if inv.source == "aws" else 1
    return planning.base_from_run(
        run or "latest", inputs["summary"], _gpu(inv, inv.instance_type), slots, inputs["link"]
    )


def _plan_target(inputs, steps, metric):
    if steps is not None:
        return steps, "given"
    if metric:
        name, value = planning.parse_metric(metric)
        return planning.steps_to(planning.eval_curve(inputs.get("eval_log", "")), name, value)
    max_steps = (inputs.get("config") or {}).get("max_steps")
    if not max_steps:
        raise planning.PlanError("no target: give --steps N or --metric NAME=VALUE")
    return int(max_steps), "the run's --steps"


def _gpu(inv, instance_type: str) -> str:
    if instance_type == inv.instance_type and inv.source != "aws":
        return planning.CPU
    known = lookup(instance_type)
    if known is None:
        raise planning.PlanError(f"unknown instance type {instance_type!r}")
    return known.gpu


def _offer(inv, name: str, base, link, spot: bool):
    gpu = _gpu(inv, name)
    known = lookup(name)
    # the cluster's own type runs the ranks it was deployed with (-c gpus_per_node); the emulated one: 1
    gpus = inv.gpus_per_node if name == inv.instance_type else (known.gpus if known else 1)
    rate, where = (link, "given") if link else (base.link_gbit, "the base run's")
    if gpu == planning.CPU:
        cpus = len(os.sched_getaffinity(0))  # the emulated cluster splits this machine's CPUs
        return planning.Offer(name, gpu, gpus, None, "the emulated cluster: no price", rate, where, cpus)
    kept = kept_price(inv, name)
    price = kept or costs.offline_price(name, inv.region or "us-east-1")
    if spot and not (inv.spot and kept):  # a Spot cluster's own type: fab inventory's price, in its nodes' AZ
        ec2 = aws_session(inv.region).client("ec2")  # an AWS error: the task's aws_errors("Spot price")
        price, _ = costs.node_price(ec2, None, name, inv.region or "us-east-1", spot=True)
    return planning.Offer(name, gpu, gpus, price.usd_per_hour, price.source, rate, where)
