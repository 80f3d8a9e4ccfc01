"""`fab drill KIND`: rehearse a failure on the running job (clusterops.run.drill)."""

from __future__ import annotations

import dataclasses

from clusterops.run import drill as drills

from .common import given, load_inventory, number, progress, task, whole_number


@task(
    help={
        "kind": "; ".join(f"{k}: {v}" for k, v in drills.KINDS.items()),
        "node": "the node to hit, its rank or name (default: the last); kill-node and cut-link refuse node0 "
        "(the supervisor's)",
        "seconds": f"slow-link, fill-data: how long the fault holds (default {drills.Drill.seconds:g})",
        "rate": f"slow-link: the cap, a tc rate (default {drills.Drill.rate})",
        "mb": f"fill-data: the file's size in MB (default {drills.Drill.mb}; removed afterwards)",
        "wait": f"the longest wait for the supervisor to act, in seconds (default {drills.Drill.wait:g})",
    },
)
def drill(c, kind=None, node=None, seconds=None, rate=None, mb=None, wait=None):
    """Inject one failure into the running job and show what the supervisor did.

    Then print the supervisor's log lines and restart, the incident's timeline and the goodput lost.
    On AWS only stop-rank runs; the others are refused (docs/operations.md, "Failure drills")."""
    if not kind:
        raise drills.DrillError(f"give a drill: `fab drill KIND`, KIND one of {', '.join(drills.KINDS)}")
    options = given(
        seconds=number(seconds, "--seconds"), rate=rate, mb=whole_number(mb, "--mb"), wait=number(wait, "--wait")
    )
    plan = drills.Drill(kind=kind, **options)
    drills.check_options(plan)
    inv = load_inventory(c)
    if node is not None:  # a rank or a name, as fab train --exclude takes them
        plan = dataclasses.replace(plan, node=inv.node(str(node)).rank)
    drills.validate(plan, inv)
    progress(f"drill: {kind}: injecting, then waiting for the supervisor (up to {plan.wait:.0f} s) ...")
    for line in drills.rehearse(inv, plan):
        print(line)
