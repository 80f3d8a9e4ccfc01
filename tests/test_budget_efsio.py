"""`fab train --budget-usd` on AWS meters EFS I/O over the run's own window: the bytes CloudWatch counted
since the run's start (AWS/EFS Data/Metadata Read/Write IOBytes, Sum) x the read and write prices, not
the $/hour of the hour before `fab train`. Against the moto server: the metric data put here is what
the meter reads. Without CloudWatch, the launch-time rate, and the budget line says so."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import boto3
import pytest
from aws_cdk.assertions import Match
from conftest import REGION, environment
from test_autostop import _template

from cluster_node.protocol import spec
from cluster_node.supervisor import efsio
from cluster_node.supervisor.budget import Meter
from clusterops import cost
from clusterops.cost import TABLE
from clusterops.run import budget as budgets

FS = "fs-0123456789abcdef0"
READ, WRITE = TABLE["efs_elastic_read_usd_per_gb"], TABLE["efs_elastic_write_usd_per_gb"]
# After a `fab data` that copied 150 GB in the hour before: what efs_io_rate measured at launch.
LAUNCH_RATE = 150 * WRITE


def _budget(**fields) -> spec.Budget:
    values = dict(usd=100.0, usd_per_node_hour=1.0, io_usd_per_hour=LAUNCH_RATE, source="the test's price table")
    values |= dict(file_system_id=FS, region=REGION, io_read_usd_per_gb=READ, io_write_usd_per_gb=WRITE)
    return spec.Budget(**{**values, **fields})


def _put(at: float, fs: str = FS, **gigabytes: float) -> None:
    """Metric data for file system `fs` at epoch time `at`, as EFS publishes it (bytes, Sum)."""
    data = [
        {
            "MetricName": metric,
            "Dimensions": [{"Name": "FileSystemId", "Value": fs}],
            "Timestamp": datetime.fromtimestamp(at, timezone.utc),
            "Value": gb * 1e9,
            "Unit": "Bytes",
        }
        for metric, gb in gigabytes.items()
    ]
    boto3.client("cloudwatch", region_name=REGION).put_metric_data(Namespace="AWS/EFS", MetricData=data)


def test_the_meter_charges_the_runs_own_efs_bytes_not_the_hour_before(aws_env):
    start = time.time() - 600
    _put(start - 1800, DataWriteIOBytes=150)  # the `fab data` copy, before the run: not the run's
    _put(start + 60, DataReadIOBytes=10, MetadataReadIOBytes=1)
    _put(start + 120, DataWriteIOBytes=2, MetadataWriteIOBytes=0.5)
    meter = Meter(_budget(), start)
    meter.add(nodes=2, now=start + 600)
    assert meter.efs.measured_usd == pytest.approx(11 * READ + 2.5 * WRITE)  # was 600 s x $9/h = $1.50
    end = efsio.minute(start + 600 - efsio.LAG_S)  # CloudWatch's last minutes: the launch-time rate for now
    assert meter.io_usd == pytest.approx(11 * READ + 2.5 * WRITE + (start + 600 - end) / 3600 * LAUNCH_RATE)
    line = meter.line(step=7)
    print(f"metered: {line}")
    assert f"= 11.000 GB read x ${READ:g} + 2.500 GB written" in line and "\n" not in line
    assert "CloudWatch, the run's own I/O" in line and "(the launch-time rate: CloudWatch publishes 5 min late)" in line

    # A run that reads its data every epoch on a fresh file system: charged as it reads (was $0/h).
    _put(start + 400, DataReadIOBytes=40)
    meter.add(nodes=2, now=start + 660)
    assert meter.efs.measured_usd == pytest.approx(11 * READ + 2.5 * WRITE)  # asked 60 s ago: not every poll
    meter.add(nodes=2, now=start + 600 + efsio.QUERY_S + 120)
    assert meter.efs.measured_usd == pytest.approx(51 * READ + 2.5 * WRITE)


def test_without_cloudwatch_the_launch_time_rate_and_the_line_says_why(moto_env):
    broken = {**moto_env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}  # nothing listens on the discard port
    with environment(broken):
        meter = Meter(_budget(), 1_000_000.0)
        began = time.monotonic()
        meter.add(nodes=1, now=1_000_000.0 + 3600)
        assert time.monotonic() - began < 30  # the supervisor's loop is not held up for long
    assert meter.io_usd == pytest.approx(LAUNCH_RATE)
    line = meter.line(step=3)
    print(f"fallback: {line}")
    assert f"1.0000 h x ${LAUNCH_RATE:g}/h (the launch-time rate: CloudWatch: " in line and "\n" not in line
    local = Meter(_budget(file_system_id="", region=""), 0.0)  # the emulated cluster: nothing to ask
    local.add(nodes=1, now=1800.0)
    assert local.io_usd == pytest.approx(LAUNCH_RATE / 2)
    assert "(the launch-time rate: no file system to meter)" in local.line(step=None)


def test_fab_costs_efs_io_counts_metadata_as_reads_and_writes(aws_env):
    now, fs = time.time(), "fs-0fab0c05700000000"  # its own: the moto server outlives each test
    _put(now - 300, fs, DataReadIOBytes=3, MetadataReadIOBytes=2, DataWriteIOBytes=1, MetadataWriteIOBytes=4)
    start, end = (datetime.fromtimestamp(t, timezone.utc) for t in (now - 600, now))
    assert cost.efs_io_gb(boto3.client("cloudwatch", region_name=REGION), fs, start, end) == pytest.approx((5, 5))


def test_fab_train_puts_the_file_system_region_and_prices_in_the_budget():
    budget = budgets.run_budget(5.0, 1.0, "kept", 2.0, file_system_id=FS, region="eu-west-1")
    assert (budget.file_system_id, budget.region) == (FS, "eu-west-1")
    assert (budget.io_read_usd_per_gb, budget.io_write_usd_per_gb) == (READ, WRITE)
    run_spec = spec.RunSpec.from_json({**_spec_json(), "budget": budget.__dict__})
    assert run_spec.budget == budget
    old = {k: v for k, v in budget.__dict__.items() if k in ("usd", "usd_per_node_hour", "io_usd_per_hour", "source")}
    assert spec.RunSpec.from_json({**_spec_json(), "budget": old}).budget.file_system_id == ""  # an older spec


def _spec_json() -> dict:
    fields = dict(run="/data/runs/r", attempt=1, supervisor_host="h1", hosts=["h1"], pool=["h1"], slots=1)
    return fields | dict(
        env={}, process_env={}, mpirun_options=[], program=["p"], ssh_config="", active_file="", python="python3"
    )


def test_the_node_role_may_read_the_efs_metrics_even_with_autostop_off():
    """GetMetricStatistics has no resource-level permissions (resource "*")."""
    statement = Match.object_like({"Action": "cloudwatch:GetMetricStatistics", "Effect": "Allow", "Resource": "*"})
    policy = {"PolicyDocument": {"Statement": Match.array_with([statement])}}
    _template(idle_minutes="0").has_resource_properties("AWS::IAM::Policy", policy)
