"""fab audit against a moto server: leftovers of every kind are found with their cost, and deleted
only after confirmation; another cluster's resources are left alone."""
import subprocess

import boto3
import pytest

from clusterops import audit
from conftest import REPO, tool_env

CLUSTER = "auditme"
TAGS = [{"Key": "gpu-cluster:name", "Value": CLUSTER}]


@pytest.fixture
def leftovers(aws_env):
    ec2 = boto3.client("ec2")
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    spec = lambda kind, tags=TAGS: [{"ResourceType": kind, "Tags": tags}]  # noqa: E731
    ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1, InstanceType="g4dn.xlarge",
                      TagSpecifications=spec("instance"))
    ec2.create_volume(AvailabilityZone="us-east-1a", Size=200, VolumeType="gp3", TagSpecifications=spec("volume"))
    other = ec2.create_volume(AvailabilityZone="us-east-1a", Size=50, TagSpecifications=spec(
        "volume", [{"Key": "gpu-cluster:name", "Value": "someone-else"}]))["VolumeId"]
    ec2.allocate_address(Domain="vpc", TagSpecifications=spec("elastic-ip"))
    ec2.create_key_pair(KeyName=f"{CLUSTER}-key", TagSpecifications=spec("key-pair"))
    subnet = ec2.describe_subnets()["Subnets"][0]["SubnetId"]
    ec2.create_network_interface(SubnetId=subnet, TagSpecifications=spec("network-interface"))
    boto3.client("efs").create_file_system(CreationToken=CLUSTER, Encrypted=True, Tags=TAGS)
    boto3.client("ssm").put_parameter(Name=f"/gpu-cluster/{CLUSTER}/ssh-host-key", Value="ssh-ed25519 AAAA",
                                      Type="String", Overwrite=True)
    boto3.client("logs").create_log_group(logGroupName=f"/{CLUSTER}/flows", tags={"gpu-cluster:name": CLUSTER})
    boto3.client("cloudwatch").put_metric_alarm(
        AlarmName=f"{CLUSTER}-idle", MetricName="CPUUtilization", Namespace="AWS/EC2", Statistic="Maximum",
        Period=300, EvaluationPeriods=1, Threshold=5, ComparisonOperator="LessThanThreshold", Tags=TAGS)
    return other


def clients():
    return {k: boto3.client(k) for k in ("ec2", "efs", "ssm", "logs", "cloudwatch")}


def test_audit_finds_every_kind_with_its_monthly_cost_and_deletes_them(leftovers):
    found = audit.find(clients(), CLUSTER)
    kinds = {x.kind for x in found}
    assert kinds == {"instance", "volume", "address", "key-pair", "network-interface", "file-system",
                     "parameter", "log-group", "alarm"}
    by_kind = {x.kind: x for x in found}
    assert by_kind["instance"].usd_per_month == pytest.approx(0.526 * 730)
    assert by_kind["volume"].usd_per_month == pytest.approx(200 * 0.08)
    assert by_kind["address"].usd_per_month == pytest.approx(0.005 * 730)
    assert all(x.id != leftovers for x in found)  # the other cluster's volume
    assert audit.delete(clients(), found, log=lambda m: None) == []
    assert audit.find(clients(), CLUSTER) == []
    assert boto3.client("ec2").describe_volumes(VolumeIds=[leftovers])["Volumes"]


def test_fab_audit_asks_before_deleting(leftovers, aws_env):
    env = tool_env(**aws_env)
    listed = subprocess.run(["fab", "audit", "--cluster", CLUSTER], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0 and "total: $" in listed.stdout and "file-system" in listed.stdout
    declined = subprocess.run(["fab", "audit", "--cluster", CLUSTER, "--delete"], cwd=REPO, env=env, input="no\n",
                              capture_output=True, text=True, timeout=120)
    assert declined.returncode == 1 and "nothing deleted" in declined.stderr
    assert len(audit.find(clients(), CLUSTER)) == 9
    deleted = subprocess.run(["fab", "audit", "--cluster", CLUSTER, "--delete", "--yes"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    assert deleted.returncode == 0, deleted.stderr
    again = subprocess.run(["fab", "audit", "--cluster", CLUSTER], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120)
    assert "nothing tagged gpu-cluster:name=auditme" in again.stdout
