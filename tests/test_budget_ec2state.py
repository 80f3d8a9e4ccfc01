"""The `--budget-usd` meter on AWS as issue 28 read it: the nodes it meters come from EC2's state at every
reading (a Spot node EC2 stops and starts again bills again), a Spot cluster is metered at the most a
node-hour can cost (not the Spot price `fab inventory` saw, maybe weeks ago), and an EFS I/O rate nobody
knows is refused, never metered as $0."""

from __future__ import annotations

import dataclasses
import io
import json
import time
from contextlib import redirect_stdout

import boto3
import pytest
from botocore.stub import Stubber
from conftest import REGION, environment, moto_instances
from test_budget import BUDGET
from test_supervisor import NOW

from cluster_node.protocol import rundir, spec
from cluster_node.supervisor.budget import Meter, Spend
from cluster_node.supervisor.ec2state import Ec2Billing
from clusterops import cost as costs
from clusterops.inventory import Inventory, Node, SshSettings
from clusterops.run import budget as budgets
from clusterops.run import launch

ISO = "%Y-%m-%dT%H:%M:%SZ"


def _notice(instance_id: str, noticed: float, action: float) -> dict:
    return rundir.Interruption(
        node=1,
        instance_id=instance_id,
        host="10.0.0.2",
        action="stop",
        action_time=time.strftime(ISO, time.gmtime(action)),
        noticed=time.strftime(ISO, time.gmtime(noticed)),
    ).to_json()


def test_a_spot_node_ec2_stops_and_starts_again_is_metered_again(aws_env, tmp_path):
    """EC2 User Guide, instance lifecycle: usage bills in `running`. A Spot node EC2 stops at its notice and
    starts again when capacity returns bills from then on. Before: the notice dropped it for good, and the
    run's last hours on it went unmetered."""
    ids = moto_instances(2, "restarted")
    ec2 = boto3.client("ec2")
    budget = dataclasses.replace(BUDGET, usd=1e6, nodes=2, instance_ids=tuple(ids), region=REGION)  # $1/node-s
    meter = Meter(budget, start=NOW)
    (tmp_path / rundir.INTERRUPTIONS).write_text(json.dumps([_notice(ids[1], NOW + 1, NOW + 2)]))
    meter.save(tmp_path, NOW + 2)  # 2 nodes x 2 s
    ec2.stop_instances(InstanceIds=[ids[1]])  # the interruption's stop
    meter.save(tmp_path, NOW + 4)  # it went mid-interval: counted whole, 2 x 2 s
    meter.save(tmp_path, NOW + 6)  # 1 x 2 s
    ec2.start_instances(InstanceIds=[ids[1]])  # capacity is back: EC2 starts it again
    meter.save(tmp_path, NOW + 8)  # it came back mid-interval: 2 x 2 s
    meter.save(tmp_path, NOW + 10)  # 2 x 2 s
    assert meter.nodes_usd == pytest.approx(4 + 4 + 2 + 4 + 4)
    assert rundir.read_record(tmp_path / rundir.BUDGET, Spend).nodes == 2


def test_without_an_answer_from_ec2_every_node_is_metered_and_the_log_says_why_once(tmp_path):
    def unreachable(ids, region):
        raise RuntimeError("Could not connect to the endpoint URL")

    budget = dataclasses.replace(BUDGET, usd=1e6, nodes=1, instance_ids=("i-1", "i-2"), region=REGION)
    meter = Meter(budget, start=NOW)
    assert meter.ec2 is not None
    meter.ec2.ask = unreachable
    lines: list[str] = []
    for t in (1, 2):
        meter.save(tmp_path, NOW + t, lines.append)
    assert meter.nodes_usd == pytest.approx(2 + 2)  # the safe side: both nodes
    assert lines == [
        "launcher: the budget meter cannot read the nodes' state (EC2: Could not connect to the endpoint URL); "
        "metering 2 node(s)"
    ]


def test_a_hanging_ec2_holds_a_reading_about_a_second():
    def hangs(ids, region):
        time.sleep(5)
        return set(ids)

    billing = Ec2Billing(("i-1",), REGION, 1, ask=hangs)
    started = time.monotonic()
    assert billing.update() == 1
    assert time.monotonic() - started < 2.5


def test_the_instance_ids_travel_in_the_run_spec(tmp_path):
    from supervisor_fixture import write_spec

    run_spec = write_spec(tmp_path, ["train.py"], ["h1"])
    budget = dataclasses.replace(BUDGET, instance_ids=("i-1", "i-2"), region=REGION)
    spec.write(tmp_path, dataclasses.replace(run_spec, budget=budget))
    assert spec.read(tmp_path).budget == budget


# ---------------------------------------------------------------- the price a Spot budget meters at


def _ec2_stub():
    client = boto3.client("ec2", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    return client, Stubber(client)


def test_a_spot_budget_meters_at_the_nodes_spot_max_price():
    ec2, stubber = _ec2_stub()
    requests = [{"SpotInstanceRequestId": f"sir-{n}", "SpotPrice": "0.450000", "InstanceId": f"i-{n}"} for n in (1, 2)]
    stubber.add_response("describe_spot_instance_requests", {"SpotInstanceRequests": requests})
    with stubber:
        price = costs.spot_ceiling(ec2, None, "g4dn.xlarge", REGION, ["i-1", "i-2"])
    assert price.usd_per_hour == 0.45 and "spot_max_price" in price.source


def test_without_a_max_price_a_spot_budget_meters_at_on_demand():
    ec2, stubber = _ec2_stub()
    stubber.add_response("describe_spot_instance_requests", {"SpotInstanceRequests": []})
    with stubber:
        price = costs.spot_ceiling(ec2, None, "g4dn.xlarge", REGION, ["i-1"])
    assert price.usd_per_hour == 0.526 and price.source.startswith("On-Demand: the most a Spot node")


def _aws_inventory(tmp_path, ids, spot=False) -> Inventory:
    return Inventory(
        cluster="c",
        source="aws",
        gpus_per_node=1,
        nodes=[Node(r, f"node{r}", f"198.51.100.{r + 1}", f"10.0.0.{r + 9}", i) for r, i in enumerate(ids)],
        ssh=SshSettings("root", 4444, "/k", str(tmp_path / "known_hosts")),
        instance_type="g4dn.xlarge",
        region=REGION,
        file_system_id="fs-0b0d9e7000000000a",
        usd_per_hour=0.1578 if spot else 0.526,  # the Spot price `fab inventory` saw, weeks ago
        price_source="Spot price, us-east-1a, since 2026-10-01 00:00 UTC" if spot else "offline table",
        spot=spot,
    )


def _budgeted(inv: Inventory, monkeypatch) -> tuple[launch.LaunchPlan, str]:
    from clusterops.run import trainlaunch

    monkeypatch.setattr(trainlaunch, "_prediction", lambda *args: (None, "no finished run"))  # it reads the head node
    plan = launch.LaunchPlan(launch.TrainRequest(budget_usd=50.0), tuple(inv.nodes), "ens5", "/w")
    out = io.StringIO()
    with redirect_stdout(out):
        planned = trainlaunch._budgeted(None, inv, plan, None, budgets.Trains(600, ("objects", 64), "transformer-tiny"))
    return planned, out.getvalue()


def test_fab_train_meters_a_spot_cluster_at_the_most_a_node_costs_and_says_so(aws_env, tmp_path, monkeypatch):
    """Before: the Spot price `fab inventory` kept ($0.1578), though the Spot price moves up to On-Demand."""
    ids = moto_instances(2, "spotbudget")
    planned, out = _budgeted(_aws_inventory(tmp_path, ids, spot=True), monkeypatch)
    assert planned.budget is not None and planned.budget.usd_per_node_hour == 0.526
    assert "at $0.526/node-h [On-Demand: the most a Spot node with no max price costs" in out
    assert planned.budget.instance_ids == tuple(ids)  # the meter asks EC2 which of them bill


def test_an_unknown_efs_io_rate_is_refused_not_metered_as_zero(moto_env, tmp_path, monkeypatch):
    """The budget's own rule: a price nobody knows cannot be metered, never $0. CloudWatch unreachable."""
    from socket import socket

    with socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with environment({**moto_env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_MAX_ATTEMPTS": "1"}):
        with pytest.raises(budgets.BudgetError, match=r"^EFS I/O rate unknown \(CloudWatch did not answer"):
            _budgeted(_aws_inventory(tmp_path, ["i-0aaaaaaaaaaaaaaa1"]), monkeypatch)
