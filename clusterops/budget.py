"""`fab train --budget-usd X`: what the run may spend, priced as `fab cost` projects it (nodes x
$/node-hour, the Spot price `fab inventory` kept on a Spot cluster, EFS I/O: on AWS the run's own bytes
from CloudWatch, else the last hour's rate), and
the refusal before anything starts when `fab plan`'s prediction for the requested steps exceeds X by more
than the margin. The supervisor meters the spend while the run goes (cluster_node/budget.py)."""

from __future__ import annotations

from typing import Optional

from cluster_node.spec import Budget

from . import plan as planning
from .cost import TABLE
from .launch import LaunchError

# fab plan's time model is held to 20% of measured runs (issue 22 part 1, tests/test_plan.py): a prediction
# less than 20% over the budget may still fit; the meter on the head node stops it if it does not.
DEFAULT_MARGIN = 0.2


class BudgetError(LaunchError):
    """A budget that cannot be kept, in one line."""


def run_budget(
    usd: float,
    usd_per_node_hour: Optional[float],
    source: str,
    io_usd_per_hour: float,
    file_system_id: str = "",
    region: str = "",
) -> Budget:
    """The spec's budget; a price nobody knows cannot be metered, so it is refused, never taken as $0. With
    a file system id (on AWS) the head node meters EFS I/O from CloudWatch at Elastic throughput's prices;
    io_usd_per_hour (the hour before the launch) is its fallback."""
    if usd <= 0:
        raise BudgetError(f"invalid --budget-usd {usd:g}: a positive number of dollars")
    if usd_per_node_hour is None:
        raise BudgetError(
            f"no price known for the nodes ({source}): --budget-usd cannot be metered; run `fab inventory`"
        )
    return Budget(
        usd=usd,
        usd_per_node_hour=usd_per_node_hour,
        io_usd_per_hour=io_usd_per_hour,
        source=source,
        file_system_id=file_system_id,
        region=region,
        io_read_usd_per_gb=TABLE["efs_elastic_read_usd_per_gb"],
        io_write_usd_per_gb=TABLE["efs_elastic_write_usd_per_gb"],
    )


def checkpoint_gb(summary: dict, config: dict, steps: int) -> float:
    """GB the run writes to EFS in checkpoints (as `fab plan` counts them)."""
    every = config.get("checkpoint_every") or 0
    return (summary.get("checkpoint_mb") or 0.0) * (steps // every) / 1000 if every else 0.0


def predict(base: planning.Base, offer: planning.Offer, nodes: int, steps: int, write_gb: float) -> planning.Estimate:
    """fab plan's estimate for this cluster and node count (no root volumes: they bill with or without
    the run, and the meter does not count them either)."""
    return planning.estimate(base, offer, nodes, steps, planning.Storage(root_gb=0.0, write_gb=write_gb))


def refusal(estimate: planning.Estimate, steps: int, budget_usd: float, margin: float) -> Optional[str]:
    """One line when the prediction exceeds the budget by more than the margin, else None."""
    total = estimate.usd_total
    if total is None or total <= budget_usd * (1 + margin):
        return None
    return (
        f"fab plan predicts ${total:,.2f} for {steps} steps on {estimate.nodes} x {estimate.instance_type} "
        f"({(estimate.hours or 0) * 60:.1f} min at {(estimate.step_s or 0) * 1e3:.0f} ms/step; nodes, storage, "
        f"EFS I/O), over --budget-usd {budget_usd:g} by more than {margin:.0%}: nothing started; raise the budget, "
        f"train fewer --steps, or give --budget-margin {total / budget_usd - 1:.2f} to start anyway"
    )


def requested_steps(recipe: str, steps: Optional[int]) -> int:
    """The steps the run is asked for: --steps, else the recipe's, else the trainer's default."""
    from train.catalog import RECIPES
    from train.config import TrainConfig

    return steps or int(RECIPES[recipe].get("max_steps", TrainConfig.max_steps))


def prediction(
    inputs: dict, instance_type: str, on_aws: bool, nodes: int, steps: int, price: Optional[float], source: str
) -> planning.Estimate:
    """fab plan's estimate of this launch from a measured run's inputs (analysis.plan_inputs): its step
    breakdown scaled to `nodes` of this cluster's type at this cluster's price. PlanError: no base."""
    import os

    from stacks.instance_types import lookup

    known = lookup(instance_type) if on_aws else None
    if on_aws and known is None:
        raise planning.PlanError(f"unknown instance type {instance_type!r}")
    gpu, gpus = (known.gpu, known.gpus) if known else (planning.CPU, 1)
    base = planning.base_from_run("base", inputs.get("summary") or {}, gpu, gpus, inputs.get("link") or (None, ""))
    cpus = 0 if on_aws else len(os.sched_getaffinity(0))  # the emulated cluster splits this machine's CPUs
    offer = planning.Offer(instance_type, gpu, gpus, price, source, base.link_gbit, "the base run's", cpus)
    write_gb = checkpoint_gb(inputs.get("summary") or {}, inputs.get("config") or {}, steps)
    return predict(base, offer, nodes, steps, write_gb)
