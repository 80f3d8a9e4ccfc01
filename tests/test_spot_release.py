"""A Spot node's persistent request is cancelled when the node is terminated (stacks/spot_release.py):
EC2 opens a persistent request again when its instance is terminated and launches another ("Spot Instance
requests"; cancel the request first), and CloudFormation cancels nothing when it deletes or replaces an
AWS::EC2::Instance or rolls one back. The function runs here against the moto server."""

import json

import boto3
import pytest
from aws_cdk.assertions import Template
from conftest import cdk_app
from test_audit import persistent_spot_request

from stacks import spot_release, spot_release_handler
from stacks.cluster_stack import GpuClusterStack
from stacks.pins import synth_config

PINS = {"availability_zone": "us-east-1a", "ami_id": "ami-0123456789abcdef0", "ssh_cidr": "203.0.113.0/24"}


def _event(instance_id: str, state: str = "shutting-down") -> dict:
    """EventBridge's "EC2 Instance State-change Notification" (its detail: instance-id, state)."""
    return {
        "source": "aws.ec2",
        "detail-type": "EC2 Instance State-change Notification",
        "detail": {"instance-id": instance_id, "state": state},
    }


def _states(ec2, *request_ids: str) -> list[str]:
    found = {
        r["SpotInstanceRequestId"]: r["State"]
        for r in ec2.describe_spot_instance_requests()["SpotInstanceRequests"]
        if r["SpotInstanceRequestId"] in request_ids
    }
    return [found.get(i, "cancelled") for i in request_ids]  # moto forgets a cancelled request


def test_a_terminated_node_has_its_request_cancelled_and_no_other(aws_env, monkeypatch):
    monkeypatch.setenv("CLUSTER_NAME", "spotrel")
    monkeypatch.setenv("CLUSTER_TAG", "gpu-cluster:name")
    monkeypatch.setenv("RANK_TAG", "gpu-cluster:rank")
    ec2 = boto3.client("ec2")
    node0, node1 = persistent_spot_request("spotrel"), persistent_spot_request("spotrel")
    other = persistent_spot_request("someone-else")
    ids = [r["SpotInstanceRequestId"] for r in (node0, node1, other)]

    assert spot_release_handler.handler(_event(node0["InstanceId"])) == [ids[0]]
    assert _states(ec2, *ids) == ["cancelled", "active", "active"]
    assert spot_release_handler.handler(_event(node0["InstanceId"], "terminated")) == []  # the second event
    assert spot_release_handler.handler(_event(other["InstanceId"])) == []  # another cluster's node
    assert spot_release_handler.handler(_event("i-0123456789abcdef0")) == []  # not a Spot node at all
    assert _states(ec2, *ids) == ["cancelled", "active", "active"]


class ReopenedRequests:
    """EC2 after a fast reopen: node1's persistent request holds no instance any more (moto cannot do that)."""

    def __init__(self):
        self.cancelled: list[str] = []
        rank = [{"Key": "gpu-cluster:name", "Value": "spotrel"}, {"Key": "gpu-cluster:rank", "Value": "1"}]
        self.requests = [
            {"SpotInstanceRequestId": "sir-0", "State": "active", "InstanceId": "i-0", "Tags": rank[:1]},
            {"SpotInstanceRequestId": "sir-1", "State": "open", "Tags": rank},
            {"SpotInstanceRequestId": "sir-2", "State": "open", "Tags": [rank[0], {**rank[1], "Value": "2"}]},
        ]
        # i-9: node1 of another cluster (its rule's event reaches this cluster's function too)
        self.instances = {"i-1": rank, "i-9": [{**rank[0], "Value": "other"}, rank[1]]}

    def describe_spot_instance_requests(self, Filters):
        return {"SpotInstanceRequests": self.requests}

    def describe_instances(self, InstanceIds):
        return {"Reservations": [{"Instances": [{"Tags": self.instances[i]} for i in InstanceIds]}]}

    def cancel_spot_instance_requests(self, SpotInstanceRequestIds):
        self.cancelled += SpotInstanceRequestIds


def test_a_request_ec2_reopened_before_the_event_is_found_by_the_nodes_rank(monkeypatch):
    for name, value in (
        ("CLUSTER_NAME", "spotrel"),
        ("CLUSTER_TAG", "gpu-cluster:name"),
        ("RANK_TAG", "gpu-cluster:rank"),
    ):
        monkeypatch.setenv(name, value)
    ec2 = ReopenedRequests()
    assert spot_release_handler.handler(_event("i-1", "terminated"), ec2=ec2) == ["sir-1"]
    assert ec2.cancelled == ["sir-1"]
    assert spot_release_handler.handler(_event("i-9", "terminated"), ec2=ec2) == []
    assert ec2.cancelled == ["sir-1"]


def _template(**context) -> dict:
    config = synth_config({**PINS, **context}, region=None)
    return Template.from_stack(GpuClusterStack(cdk_app(), "Cluster", config=config)).to_json()


@pytest.fixture(scope="module")
def spot() -> dict:
    return _template(spot="true", nodes="3")


def _release(template: dict) -> dict[str, dict]:
    return {k: r for k, r in template["Resources"].items() if "SpotRelease" in k}


def test_the_rule_runs_the_function_for_every_termination_and_the_function_is_the_tested_file(spot):
    release = _release(spot)
    (rule,) = [r for r in release.values() if r["Type"] == "AWS::Events::Rule"]
    pattern = rule["Properties"]["EventPattern"]
    assert pattern == {
        "source": ["aws.ec2"],
        "detail-type": ["EC2 Instance State-change Notification"],
        "detail": {"state": ["shutting-down", "terminated"]},
    }
    (function,) = [r for r in release.values() if r["Type"] == "AWS::Lambda::Function"]
    assert function["Properties"]["Code"]["ZipFile"] == spot_release.HANDLER.read_text()
    assert function["Properties"]["Environment"]["Variables"] == {
        "CLUSTER_NAME": "gpu-cluster",
        "CLUSTER_TAG": "gpu-cluster:name",
        "RANK_TAG": "gpu-cluster:rank",
    }


def test_the_function_may_cancel_only_this_clusters_requests(spot):
    (policy,) = [r for r in _release(spot).values() if r["Type"] == "AWS::IAM::Policy"]
    statements = {json.dumps(s["Action"]): s for s in policy["Properties"]["PolicyDocument"]["Statement"]}
    cancel = statements['"ec2:CancelSpotInstanceRequests"']
    assert cancel["Condition"] == {"StringEquals": {"aws:ResourceTag/gpu-cluster:name": "gpu-cluster"}}
    assert ":spot-instances-request/*" in json.dumps(cancel["Resource"])
    describe = '["ec2:DescribeInstances", "ec2:DescribeSpotInstanceRequests"]'
    assert statements[describe]["Resource"] == "*"
    assert set(statements) == {
        '"ec2:CancelSpotInstanceRequests"',
        describe,
        '["logs:CreateLogStream", "logs:PutLogEvents"]',
    }


def test_every_node_is_created_after_and_deleted_before_the_rule_the_function_and_its_role(spot):
    """CloudFormation deletes in the reverse order of DependsOn: the rule still runs the function when
    `cdk destroy` terminates the nodes."""
    release = set(_release(spot))
    instances = [r for r in spot["Resources"].values() if r["Type"] == "AWS::EC2::Instance"]
    assert len(instances) == 3 and all(release <= set(i["DependsOn"]) for i in instances)


def test_on_demand_nodes_have_no_release_function():
    assert _release(_template()) == {}
