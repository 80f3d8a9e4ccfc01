"""Issue 19 §19: what the cost guards themselves bill, counted from the synthesized stack and what
the watchdog publishes, priced from the price table (clusterops/prices.json: CloudWatch pricing,
us-east-1: $0.30 per custom metric-month, $0.10 per standard alarm-month, $3 per dashboard-month,
$0.01 per 1,000 PutMetricData requests; AWS KMS pricing: $1 per key-month; Amazon VPC pricing:
public IPv4 $0.005/h), and docs/operations.md's "Cost safety" quoting the same figures."""

import re

import pytest
from aws_cdk.assertions import Template
from conftest import REPO, cdk_app

from cluster_node.daemons.autostop import watchdog as autostop
from clusterops import cost
from clusterops.run import meter
from stacks.cluster_stack import GpuClusterStack
from stacks.config import ClusterConfig


class Capture:
    def __init__(self):
        self.names = set()

    def put_metric_data(self, Namespace, MetricData):
        self.names |= {(Namespace, d["MetricName"]) for d in MetricData}


def test_a_gpu_node_publishes_the_custom_metrics_the_estimate_counts():
    """Custom metrics bill per metric (name + dimensions) and hour that data arrives (CloudWatch pricing)."""
    sink = Capture()
    seen = autostop.Observation(time=0.0, gpu_util=40.0, gpu_memory=50.0)
    autostop.publish(sink, "i-0123456789abcdef0", True, seen)
    assert len(sink.names) == cost.GUARD_METRICS_PER_NODE == 3


def test_the_stack_creates_the_alarms_key_and_dashboard_the_estimate_counts():
    config = ClusterConfig.from_context(
        {
            "nodes": "3",
            "ssh_cidr": "203.0.113.7/32",
            "availability_zone": "us-east-1a",
            "ami_id": "ami-0123456789abcdef0",
        }
    )
    template = Template.from_stack(GpuClusterStack(cdk_app(), "Guards", config=config))
    assert len(template.find_resources("AWS::CloudWatch::Alarm")) == 3  # one per node
    assert len(template.find_resources("AWS::KMS::Key")) == 1  # the flow-log group's
    assert len(template.find_resources("AWS::CloudWatch::Dashboard")) == 1
    running, standing = cost.guards_usd_per_month(3)
    assert running == pytest.approx(3 * 0.30 + 60 * 730 / 1000 * 0.01)
    assert standing == pytest.approx(3 * 0.10 + 1.0 + 3.0)


def test_a_stack_without_flow_logs_bills_no_flow_log_key():
    """-c flow_logs=false (or an existing VPC: -c vpc_id) creates no KMS key; the guards' standing charge leaves
    its $1 a month out, in the plan and in the line fab cost prints."""
    context = {"ssh_cidr": "203.0.113.7/32", "availability_zone": "us-east-1a", "ami_id": "ami-0123456789abcdef0"}
    config = ClusterConfig.from_context({**context, "nodes": "3", "flow_logs": "false"})
    template = Template.from_stack(GpuClusterStack(cdk_app(), "NoFlowLogs", config=config))
    assert not template.find_resources("AWS::KMS::Key")
    assert meter.planned_layout(config)["flow_log_key"] is False
    _, standing = cost.guards_usd_per_month(3, flow_log_key=False)
    assert standing == pytest.approx(3 * 0.10 + 3.0)
    line = cost.Estimate(3, cost.Price(1.0, "x"), efs_gb=1.0, **meter.planned_layout(config)).guards_line()
    assert line.startswith(f"cost guards (idle alarms, dashboard, watchdog metrics): ${standing:.2f}/month")
    vpc = {"vpc_id": "vpc-0123456789abcdef0", "subnet_id": "subnet-0123456789abcdef0"}
    existing = ClusterConfig.from_context({**context, **vpc})
    assert meter.planned_layout(existing)["flow_log_key"] is False


def test_a_private_subnet_counts_its_nat_gateways_public_ip():
    """A NAT gateway holds an Elastic IP, billed as a public IPv4 address ($0.005/h, Amazon VPC pricing)."""
    private = cost.Estimate(2, cost.Price(0.752, "x"), 200, 1.0, private_subnet=True)
    hourly = 0.045 + 3 * 0.01 + 0.005
    assert private.network_usd_per_month == pytest.approx(hourly * 730)


def test_the_operations_doc_quotes_these_figures():
    text = (REPO / "docs" / "operations.md").read_text()
    section = text[text.index("## Cost safety") : text.index("## Picking `access` and `efa`")]
    running, standing = cost.guards_usd_per_month(2)
    assert f"${running:.2f} per node-month of running" in section
    assert f"${standing:.2f} a month for the default 2 nodes while the stack exists, stopped or not" in section
    network = cost.Estimate(2, cost.Price(1.0, "x"), 200, 1.0, private_subnet=True).network_usd_per_month
    assert f"~${network:.0f}/month more" in text
    assert re.search(r"prices? of CloudWatch, KMS and VPC checked \d{4}-\d{2}-\d{2}", section)
