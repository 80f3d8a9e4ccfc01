"""The autostop watchdog: its decision on recorded samples, its stop action against a moto server,
and the template's safety net (CloudWatch alarm) and tag-scoped stop permission."""
import json

import aws_cdk as cdk
import boto3
import pytest
from aws_cdk.assertions import Match, Template

import autostop
from autostop import Sample, decide
from stacks.cluster_stack import GpuClusterStack
from conftest import moto_instances
from stacks.config import ClusterConfig

MIN = 60.0


def samples(steps, gpus=None, every=MIN):
    """One sample a minute ending at t = len * every."""
    gpus = gpus or [None] * len(steps)
    return [Sample((i + 1) * every, step, gpu) for i, (step, gpu) in enumerate(zip(steps, gpus))]


@pytest.mark.parametrize("name, history, idle, stop", [
    ("steps advancing", samples(list(range(100, 161))), 60, False),
    ("stuck for the whole window, GPUs idle", samples([500] * 61, [0.0] * 61), 60, True),
    ("stuck but not for long enough", samples([500] * 30, [0.0] * 30), 60, False),
    ("stuck step but GPUs busy (a long eval)", samples([500] * 61, [0.0] * 50 + [95.0] + [0.0] * 10), 60, False),
    ("no run at all on a CPU-only node", samples([None] * 61), 60, True),
    ("advanced once inside the window", samples([500] * 40 + [501] * 21, [0.0] * 61), 60, False),
    ("disabled", samples([500] * 200, [0.0] * 200), 0, False),
])
def test_decision_on_recorded_samples(name, history, idle, stop):
    decision = decide(history, idle, now=history[-1].time)
    assert decision.stop is stop, (name, decision.reason)
    if stop:
        assert f"idle for {idle:g} min" in decision.reason


def test_latest_step_reads_the_newest_progress_file(tmp_path):
    assert autostop.latest_step(tmp_path) is None
    for run, step in (("a", 10), ("b", 20)):
        (tmp_path / "runs" / run).mkdir(parents=True)
        (tmp_path / "runs" / run / "progress.json").write_text(json.dumps({"step": step}))
    assert autostop.latest_step(tmp_path) == 20


def test_stop_action_stops_only_this_clusters_running_instances(aws_env):
    ec2 = boto3.client("ec2")
    mine, other = moto_instances(2, "autostop-a"), moto_instances(1, "autostop-b")
    assert autostop.stop_cluster(ec2, "autostop-a") == sorted(mine)
    states = {i["InstanceId"]: i["State"]["Name"] for r in ec2.describe_instances(InstanceIds=mine + other)["Reservations"]
              for i in r["Instances"]}
    assert {states[i] for i in mine} <= {"stopping", "stopped"} and states[other[0]] == "running"
    assert autostop.stop_cluster(ec2, "autostop-a") == []  # nothing left running: no second stop call


def _template(**context) -> Template:
    config = ClusterConfig.from_context({"ssh_cidr": "203.0.113.0/24", **context})
    return Template.from_stack(GpuClusterStack(cdk.App(), "Cluster", config=config))


def test_each_node_has_an_idle_alarm_that_stops_it_after_the_watchdog_would_have():
    template = _template(nodes="3", idle_minutes="45")
    template.resource_count_is("AWS::CloudWatch::Alarm", 3)
    template.has_resource_properties("AWS::CloudWatch::Alarm", {
        "MetricName": "CPUUtilization", "Namespace": "AWS/EC2", "ComparisonOperator": "LessThanThreshold",
        "Period": 300, "EvaluationPeriods": (45 + 30) // 5,
        "AlarmActions": [{"Fn::Join": ["", Match.array_with([":ec2:stop"])]}]})


def test_the_role_may_stop_only_instances_tagged_with_this_cluster():
    template = _template(cluster_name="team-a")
    template.has_resource_properties("AWS::IAM::Policy", {"PolicyDocument": {"Statement": Match.array_with([
        Match.object_like({"Action": "ec2:StopInstances", "Effect": "Allow",
                           "Condition": {"StringEquals": {"aws:ResourceTag/gpu-cluster:name": "team-a"}}})])}})


def test_idle_minutes_zero_turns_autostop_off():
    template = _template(idle_minutes="0")
    template.resource_count_is("AWS::CloudWatch::Alarm", 0)
    assert "ec2:StopInstances" not in json.dumps(template.to_json())


def test_nothing_is_retained_by_default():
    resources = _template().to_json()["Resources"].values()
    assert not [r for r in resources if r.get("DeletionPolicy") == "Retain"]
    retained = [r["Type"] for r in _template(retain_data="true").to_json()["Resources"].values()
                if r.get("DeletionPolicy") == "Retain"]
    assert retained == ["AWS::EFS::FileSystem"]


def test_fab_start_brings_stopped_nodes_back_and_refreshes_the_inventory(aws_env, tmp_path):
    import subprocess
    from clusterops.inventory import Inventory, Node, SshSettings, write_known_hosts
    from conftest import REPO, tool_env
    ec2 = boto3.client("ec2")
    ids = moto_instances(2)
    ec2.stop_instances(InstanceIds=ids)
    known = tmp_path / "known_hosts"
    write_known_hosts(known, ["198.51.100.1", "198.51.100.2"], "ssh-ed25519 AAAAHOSTKEY", 4444)
    Inventory(cluster="c", source="aws", gpus_per_node=1, region="us-east-1",
              nodes=[Node(r, f"node{r}", f"198.51.100.{r + 1}", "10.0.0.9", ids[r]) for r in range(2)],
              ssh=SshSettings("root", 4444, str(tmp_path / "k"), str(known))).save(tmp_path / "inventory.json")
    result = subprocess.run(["fab", "start"], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env=tool_env(GPU_CLUSTER_INVENTORY=str(tmp_path / "inventory.json"), **aws_env))
    assert result.returncode == 0, result.stderr
    states = {i["InstanceId"]: i for r in ec2.describe_instances(InstanceIds=ids)["Reservations"] for i in r["Instances"]}
    assert {i["State"]["Name"] for i in states.values()} == {"running"}
    fresh = Inventory.load(tmp_path / "inventory.json")
    assert [n.private_ip for n in fresh.nodes] == [states[i]["PrivateIpAddress"] for i in ids]
    assert known.read_text().splitlines() == [f"[{n.public_ip}]:4444 ssh-ed25519 AAAAHOSTKEY" for n in fresh.nodes]


def test_the_watchdog_loop_stops_an_idle_cluster_by_itself(aws_env, tmp_path):
    import subprocess
    import sys
    from conftest import AUTOSTOP_DIR, tool_env
    ec2 = boto3.client("ec2")
    ids = moto_instances(2, "idle-loop")
    (tmp_path / ".cluster").mkdir()
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "progress.json").write_text(json.dumps({"step": 120}))
    result = subprocess.run([sys.executable, str(AUTOSTOP_DIR / "autostop.py"), "--data", str(tmp_path),
                             "--interval", "0.2"], capture_output=True, text=True, timeout=60,
                            env=tool_env(CLUSTER_NAME="idle-loop", IDLE_MINUTES="0.02", **aws_env))
    assert result.returncode == 0, result.stderr
    assert "idle for 0.02 min: step stuck at 120" in (tmp_path / ".cluster" / "autostop.log").read_text()
    states = {i["State"]["Name"] for r in ec2.describe_instances(InstanceIds=ids)["Reservations"] for i in r["Instances"]}
    assert states <= {"stopping", "stopped"}
