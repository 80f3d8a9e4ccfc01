"""Tasks that answer "where does the time go?" and "what will it take?": report (--verify), runs, scale, plan."""

from __future__ import annotations

import re
from pathlib import Path

from invoke.exceptions import Exit

from cluster_node.protocol import rundir as rd
from clusterops import terminal
from clusterops.predict import plan as planning
from clusterops.run import analysis, launch, planner
from clusterops.run.meter import node_price
from train import catalog

from .common import (
    aws_errors,
    given,
    head,
    load_inventory,
    number,
    run_dir,
    settings,
    task,
    training_code_dir,
    whole_number,
)


@task(
    help={
        "run": "run name (default: the active or latest run)",
        "verify": "score one what-if: a short run with MODE (none, fp16, bf16, powersgd, batchx2, batchx4, nodes=K)",
    }
)
def report(c, run=None, verify=None):
    """The verdict on one run: compute-, communication- or input-bound.

    The verdict on one run: compute-, communication-, input-bound or mixed, with the evidence and
    what-if predictions (fp16/bf16/PowerSGD, larger batch, faster links), each with its model.
    Writes report.md and PNG plots into the run directory (`fab fetch` brings them home). With
    --verify MODE, first runs that what-if for 20 steps and keeps predicted vs measured in the run."""
    inv = load_inventory(c)
    code_dir = training_code_dir(inv) if verify else ""
    with head(inv) as conn:
        rdir = run_dir(conn, inv, run)
        if verify:
            print("\n".join(analysis.verify_run(conn, inv, rdir, verify, _base_request(c), code_dir)))
        print("\n".join(analysis.report_run(conn, inv, rdir)))


def _base_request(c) -> launch.TrainRequest:
    """The fabric.yaml settings every short run takes (as `fab scale`'s)."""
    import shlex

    return launch.TrainRequest(
        master_port=whole_number(settings(c)["master_port"], "master_port"),
        stall_minutes=number(settings(c)["stall_minutes"], "stall_minutes"),
        start_minutes=number(settings(c)["start_minutes"], "start_minutes"),
        extra_args=tuple(shlex.split("--eval-samples 16 --eval-every 100000 --checkpoint-every 100000 --log-every 10")),
    )


@task
def runs(c):
    """A table of the cluster's runs: state, steps, speed, result, cost.

    A table of the cluster's runs: state, steps, step time, objects/s, precision, compression,
    nodes, BLEU or top-1, wall time and, where the instance is priced, cost."""
    inv = load_inventory(c)
    price = node_price(inv).usd_per_hour if inv.source == "aws" else None
    with head(inv) as conn:
        print(analysis.runs_table(analysis.list_runs(conn, inv), price, inv.gpus_per_node))


def node_counts(text: str, available: int) -> list[int]:
    """--nodes 1,2,4 as counts this cluster has, or one line naming the option."""
    if not re.fullmatch(r"\d+(,\d+)*", text or ""):
        raise Exit(f"error: invalid --nodes {text!r}: node counts such as 1,2,4", code=1)
    counts = sorted({int(part) for part in text.split(",")})
    if counts[0] < 1 or counts[-1] > available:
        raise Exit(f"error: invalid --nodes {text!r}: the cluster has 1-{available} node(s)", code=1)
    return counts


@task(
    help={
        "recipe": f"one of {', '.join(catalog.RECIPES)} (fabric.yaml default)",
        "nodes": f"node counts, e.g. 1,2,4 (default {','.join(map(str, analysis.SCALE_NODE_COUNTS))})",
        "steps": f"steps per run (default {analysis.SCALE_STEPS}; the first 5 are not timed)",
        "repeat": f"runs per node count (default {analysis.SCALE_REPEATS}): the spread is shown",
        "batch_per_gpu": "batch per GPU, fixed across node counts (weak scaling)",
        "grad_compression": catalog.either(catalog.COMPRESSIONS),
        "extra": "more train.py arguments, quoted",
        "dest": f"local directory for {rd.SCALE_JSON}, {rd.SCALE_MD} and {rd.SCALING_PNG}"
        f" (default ./{rd.RUNS}/{rd.SCALE_DIR.format(recipe='RECIPE')})",
    }
)
def scale(
    c, recipe=None, nodes=None, steps=None, repeat=None, batch_per_gpu=None, grad_compression=None, extra="", dest=None
):
    """Short runs on 1..N nodes: a weak-scaling table and its plot.

    Short runs on 1..N nodes of this cluster: a weak-scaling table (step time, objects/s, speedup,
    efficiency, exposed-comm share, spread over repeats) and its plot."""
    import shlex

    inv = load_inventory(c)
    counts = node_counts(nodes or ",".join(map(str, analysis.SCALE_NODE_COUNTS)), len(inv.nodes))
    recipe = recipe or settings(c)["recipe"]
    request = launch.TrainRequest(
        recipe=recipe,
        steps=analysis.SCALE_STEPS if steps is None else whole_number(steps, "--steps"),
        batch_per_gpu=whole_number(batch_per_gpu, "--batch-per-gpu"),
        grad_compression=grad_compression,
        master_port=whole_number(settings(c)["master_port"], "master_port"),
        stall_minutes=number(settings(c)["stall_minutes"], "stall_minutes"),
        start_minutes=number(settings(c)["start_minutes"], "start_minutes"),
        extra_args=tuple(shlex.split(extra or "--eval-samples 16 --checkpoint-every 100000 --log-every 10")),
    )
    repeats = analysis.SCALE_REPEATS if repeat is None else whole_number(repeat, "--repeat")
    if not repeats or repeats < 1:
        raise Exit(f"error: invalid --repeat {repeat!r}: at least 1", code=1)
    request.validate()
    code_dir = training_code_dir(inv)
    local = Path(dest or Path(rd.RUNS, rd.SCALE_DIR.format(recipe=recipe)))
    with head(inv) as conn:
        scaled = analysis.scale(conn, inv, request, counts, repeats, code_dir, local)
    print(scaled.table)
    print(f"written: {', '.join(str(p) for p in scaled.written)} (and {scaled.cluster_dir}/ on the cluster)")


@task(
    help={
        "run": "the measured run to plan from (default: the active or latest run)",
        "steps": "the target: optimizer steps (default: the run's --steps)",
        "metric": "the target: NAME=VALUE the run's eval curve reached, e.g. bleu=60 or top1=80 (both in percent)",
        "step_s": "plan from this step time (seconds, 1 node of the first --types) instead of a run",
        "grad_mb": "with --step-s: fp32 gradient MB per step (for the all-reduce; default 0)",
        "types": "instance types, comma-separated (default: this cluster's)",
        "max_nodes": f"plan N = 1..this (default {planner.Query.max_nodes})",
        "deadline": "hours, e.g. 3 or 3h: the cheapest N and type within it",
        "spot": "price nodes at the Spot price in effect (AWS credentials)",
        "link_gbit": "the link between nodes (default: the run's, measured by `fab check`)",
        "read_gb": "GB read from EFS over the run (data set x epochs; default 0)",
        "efs_gb": "GB stored on EFS (default 0)",
        "root_gb": f"root volume GB per node (default {planning.Storage.root_gb:g}, the stack's)",
    }
)
def plan(
    c, run=None, steps=None, metric=None, step_s=None, grad_mb=None, types=None, max_nodes=None, deadline=None,
    spot=False, link_gbit=None, read_gb=None, efs_gb=None, root_gb=None,
):  # fmt: skip
    """Time and dollars to a target, per node count and type, before paying.

    Time and dollars to a target before paying: for N = 1..k nodes of each type, the predicted step,
    time, node, storage and EFS I/O dollars, each with its model, and the cheapest within --deadline."""
    inv = load_inventory(c)
    sizes = dict(grad_mb=number(grad_mb, "--grad-mb"), root_gb=number(root_gb, "--root-gb"))
    sizes.update(efs_gb=number(efs_gb, "--efs-gb"), read_gb=number(read_gb, "--read-gb"))
    query = planner.Query(
        types=tuple(t.strip() for t in (types or inv.instance_type).split(",") if t.strip()),
        steps=whole_number(steps, "--steps") if steps else None,
        metric=metric,
        step_s=number(step_s, "--step-s") if step_s else None,
        deadline_h=_hours(deadline),
        spot=bool(spot),
        link_gbit=number(link_gbit, "--link-gbit") if link_gbit else None,
        **given(max_nodes=whole_number(max_nodes, "--max-nodes"), **sizes),
    )
    with head(inv) as conn, aws_errors("Spot price"):  # the connection opens when a run is read
        planned = planner.plan(conn, inv, run_dir(conn, inv, run) if (run or not step_s) else None, run, query)
    limit, best = query.deadline_h, planned.best
    print(f"from {planned.base.source}")
    print(f"target: {planned.target} steps ({planned.target_model}); fixed global batch across N")
    for o in planned.offers:
        print(f"{o.instance_type}: {o.gpus_per_node} x {o.gpu} per node, link {o.link_source}; price {o.price_source}")
    print(terminal.table(planned.rows, list(planned.rows[0])))
    if best is None and planned.fastest is None:
        return
    if best is None:
        print("no priced plan meets the deadline" if limit else "no priced plan (prices unknown)")
        best = planned.fastest
        print(f"fastest: {best.nodes} x {best.instance_type}")
    else:
        print(f"cheapest{f' within {limit:g} h' if limit else ''}: {best.nodes} x {best.instance_type}")
    print("\n".join(f"  {figure}: {model}" for figure, model in best.models))
    print(f"  {planned.node_loss(best)}")


def _hours(text):
    if not text:
        return None
    found = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(h|m|min)?", str(text).strip())
    if not found:
        raise Exit(f"error: invalid --deadline {text!r}: hours, e.g. 3 or 3h, or 90m", code=1)
    return float(found.group(1)) / (60 if found.group(2) in ("m", "min") else 1)
