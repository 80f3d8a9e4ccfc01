"""`fab train --budget-usd X`: what the run may spend, priced as `fab cost` projects it (nodes x
$/node-hour, the Spot price `fab inventory` kept on a Spot cluster, EFS I/O: on AWS the run's own bytes
from CloudWatch, else the last hour's rate), and
the refusal before anything starts when `fab plan`'s prediction for the requested steps exceeds X by more
than the margin. The supervisor meters the spend while the run goes (cluster_node/supervisor/budget.py)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

from cluster_node.protocol.rundir import Summary
from cluster_node.protocol.spec import Budget
from clusterops.cost import TABLE
from clusterops.predict import plan as planning
from clusterops.run.launch import LaunchError, TrainRequest
from clusterops.run.resume import Saved

# fab plan's time model is held to 20% of measured runs (issue 22 part 1, tests/test_plan.py): a prediction
# less than 20% over the budget may still fit; the meter on the head node stops it if it does not.
DEFAULT_MARGIN = TrainRequest.budget_margin


class BudgetError(LaunchError):
    """A budget that cannot be kept, in one line."""


def run_budget(
    usd: float,
    usd_per_node_hour: Optional[float],
    source: str,
    io_usd_per_hour: Optional[float],
    nodes: int = 0,
    spent: float = 0.0,
    file_system_id: str = "",
    region: str = "",
    io_tail: tuple[float, ...] = (),
    instance_ids: tuple[str, ...] = (),
    emulated: bool = False,
) -> Budget:
    """The spec's budget over `nodes` (every node of the cluster: they all bill, as `fab cost` prices them,
    whichever the run uses), on top of `spent` (the run's earlier segments); a price nobody knows cannot be
    metered, so it is refused, never taken as $0. With a file system id (on AWS) the head node meters EFS I/O
    from CloudWatch at Elastic throughput's prices; io_usd_per_hour (the hour before the launch) is its
    fallback, refused when unknown (None) as the node price is. With instance ids (on AWS) the meter counts
    the nodes that bill from EC2's state at every reading."""
    if usd <= 0:
        raise BudgetError(f"invalid --budget-usd {usd:g}: a positive number of dollars")
    if usd_per_node_hour is None and emulated:
        raise BudgetError(
            "the emulated cluster bills nothing: --budget-usd meters AWS dollars; to rehearse it here, give the "
            'inventory a price ("usd_per_hour" in its inventory.json)'
        )
    if usd_per_node_hour is None:
        raise BudgetError(
            f"no price known for the nodes ({source}): --budget-usd cannot be metered; run `fab inventory`"
        )
    if io_usd_per_hour is None:
        raise BudgetError(
            "EFS I/O rate unknown (CloudWatch did not answer for the file system's last hour): --budget-usd "
            "cannot be metered; check the AWS credentials' cloudwatch:GetMetricStatistics, then `fab train` again"
        )
    return Budget(
        usd=usd,
        usd_per_node_hour=usd_per_node_hour,
        io_usd_per_hour=io_usd_per_hour,
        source=source,
        nodes=nodes,
        spent=spent,
        file_system_id=file_system_id,
        region=region,
        io_tail=io_tail,
        instance_ids=instance_ids,
        io_read_usd_per_gb=TABLE["efs_elastic_read_usd_per_gb"],
        io_write_usd_per_gb=TABLE["efs_elastic_write_usd_per_gb"],
    )


def budget_line(request: TrainRequest, budget: Budget, predicted: str) -> str:
    """The launch's budget line: the limit, the spend carried over, how many nodes it meters, the prediction,
    and whether the nodes stop when the run ends."""
    carried = f" (${budget.spent:.2f} of it spent by the run's earlier segments)" if budget.spent else ""
    stop = (
        "--keep-nodes: the nodes stay up after the run, billed, until the idle watchdog stops them (idle_minutes)"
        if request.keep_nodes
        else "the nodes stop when the run ends, however it ends (--keep-nodes keeps them up)"
    )
    metered = f"metered over {budget.nodes} node(s) at ${budget.usd_per_node_hour:g}/node-h [{budget.source}]"
    return f"budget: ${budget.usd:g}{carried}, {metered}; {predicted}; {stop}"


def spent_before(saved: Optional[Saved]) -> float:
    """What a resumed run spent so far (its budget.json) less the launch-time rate's estimate of its EFS I/O
    after io_to, which the resumed segment's meter charges itself (io_tail); 0 for a new run."""
    budget = saved.budget if saved else None
    return budget.spent - (budget.io_estimate or 0.0) if budget else 0.0


def io_tail(saved: Optional[Saved]) -> tuple[float, ...]:
    """The resumed run's EFS I/O window its last segment's meter had not read from CloudWatch (budget.json's
    io_to to its time: CloudWatch's lag, or all of it when CloudWatch did not answer), for this segment's meter
    to ask once published and charge at the launch-time rate until then; () for none."""
    budget = saved.budget if saved else None
    if budget is None or budget.io_to is None:
        return ()
    since, until = budget.io_to, budget.time
    return (since, until) if since < until else ()


def steps_to_run(max_steps: int, saved: Optional[Saved]) -> tuple[int, str]:
    """The steps the launch will train, and how to say so: `max_steps` as the trainer will see them
    (resume.check_trainer: --steps, a resumed run's saved count, or the recipe's at this launch's ranks),
    for a resumed run from its newest checkpoint."""
    if saved is None or not saved.step:
        return max_steps, f"{max_steps} steps"
    left = max(0, max_steps - saved.step)
    return left, f"the {left} steps left ({max_steps} - checkpoint {saved.step})"


def checkpoint_gb(summary: Optional[Summary], config: dict, steps: int) -> float:
    """GB the run writes to EFS in checkpoints (as `fab plan` counts them)."""
    every = config.get("checkpoint_every") or 0
    size = (summary.checkpoint_mb if summary else None) or 0.0
    return size * (steps // every) / 1000 if every else 0.0


def predict(
    base: planning.Base, offer: planning.Offer, nodes: int, steps: int, write_gb: float, batch: float = 1.0
) -> planning.Estimate:
    """fab plan's estimate for this cluster and node count (no root volumes: they bill with or without
    the run, and the meter does not count them either)."""
    return planning.estimate(base, offer, nodes, steps, planning.Storage(root_gb=0.0, write_gb=write_gb), "", batch)


def billed(estimate: planning.Estimate, cluster_nodes: int) -> planning.Estimate:
    """The estimate's node dollars for every node of the cluster (the meter's), its time for the run's nodes."""
    if estimate.usd_nodes is None or cluster_nodes <= estimate.nodes:
        return estimate
    return dataclasses.replace(estimate, usd_nodes=estimate.usd_nodes * cluster_nodes / estimate.nodes)


def refusal(
    estimate: Optional[planning.Estimate], steps: int, budget_usd: float, margin: float, spent: float = 0.0
) -> Optional[str]:
    """One line when the run already spent its budget, or the prediction exceeds what is left of it by more
    than the margin; else None."""
    left = budget_usd - spent
    if left <= 0:
        return (
            f"run already spent ${spent:.2f} of its --budget-usd {budget_usd:g}: nothing started; give a larger "
            f"--budget-usd (the limit; the spend stays the run's)"
        )
    total = estimate.usd_total if estimate else None
    if estimate is None or total is None or total <= left * (1 + margin):
        return None
    of = f" (${left:.2f} left of it)" if spent else ""
    return (
        f"fab plan predicts ${total:,.2f} for {steps} steps on {estimate.nodes} x {estimate.instance_type} "
        f"({(estimate.hours or 0) * 60:.1f} min at {(estimate.step_s or 0) * 1e3:.0f} ms/step; nodes, storage, "
        f"EFS I/O), over --budget-usd {budget_usd:g}{of} by more than {margin:.0%}: nothing started; raise the "
        f"budget, train fewer --steps, or give --budget-margin {total / left - 1:.2f} to start anyway"
    )


def prediction(
    inputs: dict,
    instance_type: str,
    on_aws: bool,
    nodes: int,
    steps: int,
    price: Optional[float],
    source: str,
    gpus_per_node: int = 1,
    per_rank: Optional[tuple[str, int]] = None,
) -> planning.Estimate:
    """fab plan's estimate of this launch from a measured run's inputs (analysis.plan_inputs): its step
    breakdown scaled to `nodes` of this cluster's type at this cluster's price, `gpus_per_node` ranks on each
    (the inventory's, as `fab plan` and the launch place them: -c gpus_per_node may use fewer than the type
    has), each rank training `per_rank` a step (rank_batch of the launch's settings; None: the base run's
    global batch split over them). PlanError: no base, or a base batched in another unit."""
    import os

    from stacks.instance_types import lookup

    known = lookup(instance_type) if on_aws else None
    if on_aws and known is None:
        raise planning.PlanError(f"unknown instance type {instance_type!r}")
    gpu, gpus = (known.gpu, gpus_per_node) if known else (planning.CPU, 1)
    base = planning.base_from_run("base", inputs.get("summary"), gpu, gpus, inputs.get("link") or (None, ""))
    cpus = 0 if on_aws else len(os.sched_getaffinity(0))  # the emulated cluster splits this machine's CPUs
    offer = planning.Offer(instance_type, gpu, gpus, price, source, base.link_gbit, "the base run's", cpus)
    config = inputs.get("config") or {}
    write_gb = checkpoint_gb(inputs.get("summary"), config, steps)
    based = rank_batch(config) if config.get("batch_per_gpu") else None  # a config.json from the base run
    batch = global_batch_ratio(per_rank, based, nodes * gpus, base.breakdown.world_size)
    return predict(base, offer, nodes, steps, write_gb, batch)


class Trains(NamedTuple):
    """What a launch trains, as the trainer will have it (resume.check_trainer's configuration)."""

    steps: int
    per_rank: tuple[str, int]  # rank_batch
    recipe: str


def trained(config) -> Trains:
    """A launch's Trains from its train.config.TrainConfig."""
    return Trains(config.max_steps, rank_batch(config.to_dict()), config.recipe)


def rank_batch(config: dict) -> tuple[str, int]:
    """What one rank trains a step, in the unit its batches are made of (train.config's fields): tokens
    when a text run batches by a --max-tokens budget, else objects (--batch-per-gpu: images, or sentence
    pairs, a token budget of --batch-per-gpu x their mean length included), times its accumulation."""
    accum = int(config.get("grad_accum") or 1)
    text = not str(config.get("recipe", "")).startswith("resnet")  # an image run takes no --max-tokens
    if text and config.get("batching", "tokens") == "tokens" and config.get("max_tokens"):
        return "tokens", int(config["max_tokens"]) * accum
    return "objects", int(config.get("batch_per_gpu") or 1) * accum


def global_batch_ratio(
    per_rank: Optional[tuple[str, int]], base: Optional[tuple[str, int]], ranks: int, base_ranks: int
) -> float:
    """A launch's global batch (`per_rank` on `ranks`, rank_batch's) against its base run's (`base` on
    `base_ranks`): the same batch per GPU on twice the ranks is 2. 1 when either is not known."""
    if per_rank is None or base is None:
        return 1.0
    if base[0] != per_rank[0]:
        sizing = {"tokens": "a --max-tokens budget", "objects": "--batch-per-gpu"}
        raise planning.PlanError(
            f"the base run's batches were sized by {sizing[base[0]]}, this launch's by {sizing[per_rank[0]]}: "
            "not comparable (give both the same sizing)"
        )
    return per_rank[1] * ranks / (base[1] * base_ranks)
