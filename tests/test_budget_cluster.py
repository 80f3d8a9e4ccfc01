"""`fab train --budget-usd` on the emulated cluster, with a price table given here (the inventory's
kept price, as `fab inventory` keeps the Pricing API's or the Spot price): the supervisor on the head node
stops the run at its budget with a checkpoint and says why; a run `fab plan` predicts over budget is refused
and changes nothing."""

from __future__ import annotations

import json
import os
import re

import pytest
from cluster_harness import QUICK, start_cluster, stop_cluster
from conftest import moto_instances

from clusterops.local import cluster as localcluster

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster needs root")]
USD_PER_NODE_HOUR = 360.0  # $0.10 a node-second: a budget of a few dollars lasts seconds
BUDGET = 6  # ~31 s of two nodes after the supervisor starts; step 1 (~7 s alone) lands first, even at 3x load


@pytest.fixture(scope="module")
def priced(tmp_path_factory):
    cluster = start_cluster("tbudget", 2, "10.213.150.0/24", tmp_path_factory.mktemp("budget"))
    inventory = json.loads(cluster.inventory.read_text())
    inventory.update(usd_per_hour=USD_PER_NODE_HOUR, price_source="the test's price table")
    cluster.inventory.write_text(json.dumps(inventory))
    # A slow link: the run's ~30 s are mostly its ranks waiting on their all-reduce (~1.8 s a step), not 60
    # CPU-seconds of steps beside the other tests (21 alone); the link fab plan prices comm at.
    localcluster.set_link_rate(cluster.name, "20mbit", cluster.inventory)
    yield cluster
    stop_cluster(cluster)


def test_a_run_stops_at_its_budget_with_a_checkpoint_and_a_run_predicted_over_it_is_refused(priced, aws_env):
    import boto3

    ids = moto_instances(2, "tbudget")  # the cluster's instances, as the watchdog's --stop-now finds them
    out = priced.fab(
        "train",
        "--run",
        "budgeted",
        "--steps",
        "5000",
        "--budget-usd",
        str(BUDGET),
        "--follow",
        "--extra",
        QUICK,
        env=aws_env,
    )
    assert "metered over 2 node(s)" in out.stdout and "the nodes stop when the run ends" in out.stdout
    status = priced.run_status("budgeted")
    assert status["state"] == "stopped" and status["kind"] == "budget", status  # resumable with a larger budget
    found = re.match(
        rf"budget: \${BUDGET}\.00 reached at step (\d+) \(\$([\d.]+) spent: nodes \$[\d.]+ = ", status["reason"]
    )
    assert found and float(found.group(2)) >= BUDGET, status["reason"]
    step = int(re.search(r"checkpoint step (\d+); then-stop: stopping the cluster$", status["reason"]).group(1))
    assert step >= int(found.group(1)) and (priced.run_dir("budgeted") / "checkpoints" / f"step_{step:08d}.pt").exists()
    assert f"launcher: budget: ${BUDGET}.00 reached at step" in out.stdout
    described = boto3.client("ec2").describe_instances(InstanceIds=ids)["Reservations"]
    assert {i["State"]["Name"] for r in described for i in r["Instances"]} <= {"stopping", "stopped"}
    print(f"budget run: {status['reason']}")

    spent = json.loads((priced.run_dir("budgeted") / "budget.json").read_text())
    assert spent["usd"] == BUDGET and spent["spent"] >= float(found.group(2)), spent
    again = priced.fab("train", "--run", "budgeted", check=False)  # the saved budget, already spent
    assert (
        again.returncode == 1
        and f"run already spent ${spent['spent']:.2f} of its --budget-usd {BUDGET}" in again.stderr
    )
    assert priced.run_status("budgeted") == status  # nothing started

    runs = sorted(p.name for p in (priced.shared / "runs").iterdir())
    refused = priced.fab("train", "--run", "toolong", "--steps", "100000", "--budget-usd", str(BUDGET), check=False)
    assert refused.returncode == 1, refused.stdout
    [line] = refused.stderr.strip().splitlines()
    assert line.startswith("error: fab plan predicts $") and "for 100000 steps on 2 x" in line, line
    assert sorted(p.name for p in (priced.shared / "runs").iterdir()) == runs  # nothing written, .active neither
    print(f"refused: {line}")
