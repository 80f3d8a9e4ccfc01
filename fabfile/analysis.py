"""Tasks that answer "where does the time go?": report, runs, scale."""

from __future__ import annotations

import re
from pathlib import Path

from invoke.exceptions import Exit

from clusterops import analysis, launch
from train import catalog

from .common import head, load_inventory, node_price, number, run_dir, settings, task, training_code_dir, whole_number


@task(help={"run": "run name (default: the active or latest run)"})
def report(c, run=None):
    """The verdict on one run: compute-, communication- or input-bound.

    The verdict on one run: compute-, communication-, input-bound or mixed, with the evidence and
    what-if predictions (fp16/bf16/PowerSGD, larger batch, faster links), each with its model.
    Writes report.md and PNG plots into the run directory (`fab fetch` brings them home)."""
    inv = load_inventory(c)
    with head(inv) as conn:
        print("\n".join(analysis.report_run(conn, inv, run_dir(conn, inv, run))))


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
        "nodes": "node counts, e.g. 1,2,4 (default 1,2)",
        "steps": "steps per run (default 30; the first 5 are not timed)",
        "repeat": "runs per node count (default 2): the spread is shown",
        "batch_per_gpu": "batch per GPU, fixed across node counts (weak scaling)",
        "grad_compression": catalog.either(catalog.COMPRESSIONS),
        "extra": "more train.py arguments, quoted",
        "dest": "local directory for scale.json, scale.md and scaling.png (default ./runs/scale-RECIPE)",
    }
)
def scale(
    c, recipe=None, nodes="1,2", steps="30", repeat="2", batch_per_gpu=None, grad_compression=None, extra="", dest=None
):
    """Short runs on 1..N nodes: a weak-scaling table and its plot.

    Short runs on 1..N nodes of this cluster: a weak-scaling table (step time, objects/s, speedup,
    efficiency, exposed-comm share, spread over repeats) and its plot."""
    import shlex

    inv = load_inventory(c)
    counts = node_counts(nodes, len(inv.nodes))
    recipe = recipe or settings(c)["recipe"]
    request = launch.TrainRequest(
        recipe=recipe,
        steps=whole_number(steps, "--steps"),
        batch_per_gpu=whole_number(batch_per_gpu, "--batch-per-gpu"),
        grad_compression=grad_compression,
        master_port=whole_number(settings(c)["master_port"], "master_port"),
        stall_minutes=number(settings(c)["stall_minutes"], "stall_minutes"),
        start_minutes=number(settings(c)["start_minutes"], "start_minutes"),
        extra_args=tuple(shlex.split(extra or "--eval-samples 16 --checkpoint-every 100000 --log-every 10")),
    )
    repeats = whole_number(repeat, "--repeat")
    if not repeats or repeats < 1:
        raise Exit(f"error: invalid --repeat {repeat!r}: at least 1", code=1)
    request.validate()
    code_dir = training_code_dir(inv)
    with head(inv) as conn:
        points = analysis.run_scale(conn, inv, request, counts, repeats, code_dir)
        local = Path(dest or f"runs/scale-{recipe}")
        written = analysis.write_scale(conn, inv, recipe, points, local)
    from clusterops import scaling

    print(scaling.table(points, scaling.shared_cores(inv.source)))
    print(f"written: {', '.join(str(p) for p in written)} (and {analysis.scale_dir(inv, recipe)}/ on the cluster)")
