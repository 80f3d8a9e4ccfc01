"""The deploy rehearsal: each configuration deployed into the moto server, then every node runs what it would
run on AWS, against that deployed stack, under the deployed node role's own credentials, through the gate
(tests/rehearsal.py) that authorizes each call by the role's policy as deployed and checks each name that
crosses from the template into a node:

- the user data as EC2 holds it, in the bootstrap sandbox, with the real AWS CLI (awscli from PyPI);
- the boot unit that resets the node's idle alarm;
- the idle watchdog's heartbeat, and `--then-stop` (the watchdog's stop of the whole cluster).

Then: no call was denied, each node signalled SUCCESS for its own resource (which waits for that signal),
each alarm watches a metric its node published, and every name a node used exists in the template."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
from bootstrap_sandbox import Sandbox, host_paths
from conftest import ACCOUNT, REGION, REPO, environment, idle_alarm, run_fab, tool_env
from iampolicy import Request, evaluate
from moto_deploy import MOTO_LIMITS, deploy
from rehearsal import Gate, efs_mount_refusals, user_data
from test_audit import persistent_spot_request

from clusterops.inventory import Inventory

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for the bootstrap sandbox's mount namespace"),
    # One worker runs the laptop rehearsals and the policy check that needs both of them (USED), and so the
    # boots of the configurations they deploy; the other two configurations are groups of their own (below),
    # deployed into their worker's moto server. The sandboxes' host paths are shared safely (host_paths' flock).
    pytest.mark.xdist_group("rehearsal"),
    pytest.mark.slow,
]

SSH = {"ssh_cidr": "203.0.113.0/24"}
CONFIGS = {
    "default": {"cluster_name": "rh-default", "data_bucket": "rh-default-imagenet", **SSH},
    "spot": {"cluster_name": "rh-spot", "spot": "true", "instance_type": "g5.12xlarge", **SSH},
    "p4d-efa": {"cluster_name": "rh-p4d", "access": "ssm", "private_subnet": "true", "instance_type": "p4d.24xlarge"},
}


@pytest.fixture(scope="module", autouse=True)
def mountpoints():
    yield from host_paths()


class Deployed:
    """One configuration deployed: the stack as CloudFormation holds it, and its nodes."""

    def __init__(self, name: str, context: dict, key_file):
        self.name, self.context, self.key_file = name, context, key_file
        self.stack = f"GpuCluster-{context['cluster_name']}"
        cloudformation = boto3.client("cloudformation")
        body = cloudformation.get_template(StackName=self.stack)["TemplateBody"]
        self.template = json.loads(body) if isinstance(body, str) else body
        resources = cloudformation.list_stack_resources(StackName=self.stack)["StackResourceSummaries"]
        physical = {r["LogicalResourceId"]: r["PhysicalResourceId"] for r in resources}
        self.instances = [physical[k] for k in sorted(self._of_type("AWS::EC2::Instance"), key=self._rank)]
        (self.role,) = [physical[k] for k in self._of_type("AWS::IAM::Role") if "NodeRole" in k]

    def _of_type(self, kind: str) -> dict:
        return {k: r for k, r in self.template["Resources"].items() if r["Type"] == kind}

    def _rank(self, logical_id: str) -> int:
        return int(logical_id.split("Node", 2)[2][0]) if logical_id.count("Node") > 1 else 0

    def names(self, kind: str, prop: str) -> set[str]:
        return {
            r["Properties"][prop] for r in self._of_type(kind).values() if isinstance(r["Properties"].get(prop), str)
        }

    def physical_of(self, kind: str) -> list[str]:
        summaries = boto3.client("cloudformation").list_stack_resources(StackName=self.stack)["StackResourceSummaries"]
        return [r["PhysicalResourceId"] for r in summaries if r["ResourceType"] == kind]

    def alarms(self) -> list[dict]:
        return [r["Properties"] for r in self._of_type("AWS::CloudWatch::Alarm").values()]


@pytest.fixture(scope="module")
def world(moto_env):
    """The moto server's variables for the module, and one gate in front of it."""
    with environment(moto_env):
        gate = Gate(moto_env["AWS_ENDPOINT_URL"], boto3.session.Session())
        with gate.serving() as endpoint:
            yield gate, endpoint


# Configurations that no laptop rehearsal deploys: each on a worker of its own (make test: --dist loadgroup).
# (p4d-efa is also the Session Manager configuration: access=ssm in a private subnet. A separate g4dn one booted
# the same user data less its EFA lines, for ~40 CPU-seconds of the suite.)
ALONE = ("p4d-efa",)


@pytest.fixture(
    scope="module",
    params=[pytest.param(c, marks=[pytest.mark.xdist_group(f"rehearsal-{c}")] if c in ALONE else []) for c in CONFIGS],
)
def deployed(request, world, moto_env, tmp_path_factory) -> Deployed:
    name = request.param
    work = tmp_path_factory.mktemp(name)
    deploy(moto_env, work, CONFIGS[name], CONFIGS[name].get("instance_type", "g4dn.2xlarge"))
    return Deployed(name, CONFIGS[name], work / f"{CONFIGS[name]['cluster_name']}-key.pem")


def node_env(gate: Gate, endpoint: str, deployed: Deployed, rank: int) -> dict:
    """What a process on node `rank` has: its role's credentials from the instance profile, its region."""
    instance_id = deployed.instances[rank]
    return {
        **gate.assume(deployed.role, instance_id),
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_CONFIG_FILE": "/dev/null",
        "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
        "IMDS_INSTANCE_ID": instance_id,
        "INSTANCE_ID": instance_id,
    }


def boot(tmp_path, gate: Gate, endpoint: str, deployed: Deployed, rank: int) -> Sandbox:
    """Node `rank`'s first boot: its deployed user data, then its every-boot alarm reset, in a sandbox whose
    `aws` is the real AWS CLI."""
    (tmp_path / f"node{rank}").mkdir()
    sandbox = Sandbox(tmp_path / f"node{rank}")
    (sandbox.root / "bin" / "aws").unlink()
    (sandbox.root / "bin" / "aws").symlink_to(REPO / ".venv" / "bin" / "aws")
    (sandbox.root / "user-data.sh").write_text(user_data(gate.admin, deployed.instances[rank]))
    env = node_env(gate, endpoint, deployed, rank)
    first = sandbox.run(**env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    file_system = next(r["Properties"] for r in deployed._of_type("AWS::EFS::FileSystem").values())
    assert efs_mount_refusals(file_system, (sandbox.root / "fstab").read_text()) == []
    reset = sandbox.command("/usr/local/sbin/gpu-cluster-bootstrap /etc/gpu-cluster/bootstrap.env reset-alarm", **env)
    assert reset.returncode == 0, reset.stdout[-2000:] + reset.stderr[-2000:]
    return sandbox


def node_program(args: list[str], env: dict, seconds: float = 60) -> str:
    """A node program as the container runs it (`python -m ...`, the node's variables), for at most `seconds`:
    a daemon is stopped then, as at a shutdown. Returns its output."""
    try:
        done = subprocess.run(
            [sys.executable, *args], env=tool_env(**env), capture_output=True, text=True, timeout=seconds
        )
        return done.stdout + done.stderr
    except subprocess.TimeoutExpired as stopped:
        return f"{stopped.stdout or ''}{stopped.stderr or ''}"


def watch_for_rounds(gate: Gate, args: list[str], env: dict, rounds: int = 2, seconds: float = 120) -> None:
    """The watchdog daemon until it has published `rounds` heartbeats (at most `seconds`), then stopped as at a
    shutdown: counted, not timed (8 s once held none on a loaded machine: its start-up took them all)."""

    def beats() -> int:
        return sum(c.action == "cloudwatch:PutMetricData" for c in list(gate.calls))

    wanted, deadline = beats() + rounds, time.monotonic() + seconds
    daemon = subprocess.Popen(
        [sys.executable, *args], env=tool_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        while beats() < wanted and daemon.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        daemon.terminate()
        out = daemon.communicate(timeout=30)[0].decode(errors="replace")
    assert beats() >= wanted, f"{beats()} heartbeats, {wanted} wanted; the watchdog said:\n{out[-3000:]}"


def run_node_programs(gate: Gate, endpoint: str, deployed: Deployed, tmp_path) -> None:
    """On node 0: the idle watchdog's heartbeat for a few rounds, the budget meter's EFS I/O reading and its
    nodes that bill (EC2's instance state), then
    `--then-stop` (fab train's, and the budget's, stop of the whole cluster), as the container runs them."""
    env = {
        **node_env(gate, endpoint, deployed, 0),
        "AWS_REGION": REGION,
        "CLUSTER_NAME": deployed.context["cluster_name"],
        "NODE_RANK": "0",
        "IDLE_MINUTES": "60",
    }
    data = tmp_path / "data"
    data.mkdir()
    watchdog = ["-m", "cluster_node.daemons.autostop.watchdog", "--data", str(data), "--pts", str(tmp_path)]
    watch_for_rounds(gate, [*watchdog, "--interval", "1"], env)
    file_system = next(iter(deployed.physical_of("AWS::EFS::FileSystem")))
    meter = (
        "from cluster_node.supervisor import efsio; import time; "
        f"print(efsio.measure({file_system!r}, {REGION!r}, time.time() - 3600, time.time()))"
    )
    node_program(["-c", meter], env)
    ids = tuple(deployed.instances)
    billing = node_program(
        ["-c", f"from cluster_node.supervisor import ec2state; print(ec2state.billing_ids({ids!r}, {REGION!r}))"], env
    )
    assert "i-" in billing, billing  # the budget meter's nodes that bill, from EC2's instance state
    stopped = node_program([*watchdog, "--stop-now"], env)
    assert "stopping" in stopped, stopped


def test_every_node_boots_signals_its_own_resource_and_stops_its_cluster_within_its_role(deployed, world, tmp_path):
    gate, endpoint = world
    before, violations = len(gate.calls), len(gate.violations)
    for rank in range(len(deployed.instances)):
        boot(tmp_path, gate, endpoint, deployed, rank)
    run_node_programs(gate, endpoint, deployed, tmp_path)
    ours = gate.calls[before:]
    assert gate.violations[violations:] == []
    # Each node signalled SUCCESS once, for its own resource (the stand-in checked it exists and waits).
    signalled = [s for s in gate.signals if s["StackName"] == deployed.stack]
    assert sorted(s["instance"] for s in signalled if s["Status"] == "SUCCESS") == sorted(deployed.instances)
    # Every alarm watches a metric that its node published, and every alarm a node reset exists.
    published = {
        (
            c.params.get("Namespace"),
            m.get("MetricName"),
            tuple((d["Name"], d["Value"]) for d in m.get("Dimensions", [])),
        )
        for c in ours
        if c.action == "cloudwatch:PutMetricData"
        for m in c.params.get("MetricData", [])
    }
    for alarm in deployed.alarms():
        dimensions = tuple((d["Name"], d["Value"]) for d in alarm["Dimensions"])
        dimensions = tuple((n, v if isinstance(v, str) else _physical(deployed, v)) for n, v in dimensions)
        assert (alarm["Namespace"], alarm["MetricName"], dimensions) in published, alarm["AlarmName"]
    reset = {c.params["AlarmName"] for c in ours if c.action == "cloudwatch:SetAlarmState"}
    assert reset and reset <= deployed.names("AWS::CloudWatch::Alarm", "AlarmName")
    used = {c.params["Name"] for c in ours if c.action.startswith("ssm:") and "Name" in c.params}
    assert used <= deployed.names("AWS::SSM::Parameter", "Name")
    assert all(n.startswith(f"/gpu-cluster/{deployed.context['cluster_name']}/") for n in used), used
    # --then-stop stopped this cluster's nodes, and those only.
    stops = [i.split("/")[-1] for c in ours if c.action == "ec2:StopInstances" for i in c.resources]
    assert sorted(stops) == sorted(deployed.instances)
    heartbeats = [c for c in ours if c.action == "cloudwatch:PutMetricData" and "--stop-now" not in str(c.params)]
    assert len(heartbeats) >= 2 + len(deployed.instances)  # the boot beats, then the watchdog's rounds
    assert any(c.action == "cloudwatch:GetMetricStatistics" and "AWS/EFS" in str(c.params) for c in ours)


def test_a_node_fetches_imagenet_from_its_data_bucket_and_from_no_other(deployed, world, tmp_path):
    """-c data_bucket: prepare.py imagenet --from, as node 0's container runs it under the deployed role, lists
    and reads that bucket (ListObjectsV2 as s3:ListBucket, GetObject), and is refused any other in one line."""
    if "data_bucket" not in deployed.context:
        pytest.skip("deployed without -c data_bucket")
    gate, endpoint = world
    s3 = boto3.client("s3")
    for bucket in (deployed.context["data_bucket"], f"{deployed.context['data_bucket']}-not-granted"):
        s3.create_bucket(Bucket=bucket)
        for split in ("train", "val"):
            s3.put_object(Bucket=bucket, Key=f"imagenet/{split}/n01/img.JPEG", Body=b"\xff\xd8 an image")
    before, violations = len(gate.calls), len(gate.violations)
    env = {**node_env(gate, endpoint, deployed, 0), "AWS_REGION": REGION}
    prepare = ["-m", "train.prepare", "imagenet", "--source", str(tmp_path / "imagenet"), "--from"]
    out = node_program([*prepare, f"s3://{deployed.context['data_bucket']}/imagenet"], env)
    assert "fetched into" in out and "1 classes, 1 train and 1 val images" in out, out
    assert gate.violations[violations:] == []
    assert {c.action for c in gate.calls[before:]} == {"s3:ListBucket", "s3:GetObject"}
    refused = node_program([*prepare, f"s3://{deployed.context['data_bucket']}-not-granted/imagenet"], env)
    error = refused.strip().splitlines()[-1]  # after its progress line, one line
    assert error.startswith("error: s3://") and "AccessDenied" in error and "Traceback" not in refused, refused
    assert len(gate.violations) == violations + 1  # the other bucket's listing, refused


def beyond_its_needs(deployed: Deployed) -> list[Request]:
    """What a node of this cluster must not be able to do: read other secrets and parameters, overwrite
    its own code's location, stop, alarm, signal or publish for anyone else."""
    cluster, arn = deployed.context["cluster_name"], f"arn:aws:{{}}:{REGION}:{ACCOUNT}:{{}}"
    return [
        Request("ssm:GetParameter", arn.format("ssm", "parameter/ec2/keypair/key-0123456789abcdef0")),
        Request("ssm:GetParameter", arn.format("ssm", "parameter/gpu-cluster/another/image-context")),
        Request("ssm:GetParameter", arn.format("ssm", f"parameter/gpu-cluster/{cluster}x/image-context")),
        Request("ssm:PutParameter", arn.format("ssm", f"parameter/gpu-cluster/{cluster}/image-context")),
        Request(
            "ec2:StopInstances",
            arn.format("ec2", "instance/i-0another"),
            {"aws:ResourceTag/gpu-cluster:name": "another"},
        ),
        Request("ec2:StopInstances", arn.format("ec2", "instance/i-0untagged")),
        Request("cloudwatch:SetAlarmState", arn.format("cloudwatch", "alarm:another-node0-idle")),
        Request("cloudwatch:PutMetricData", "*", {"cloudwatch:namespace": "AWS/EC2"}),
        Request("cloudformation:SignalResource", arn.format("cloudformation", "stack/another/1")),
        Request("s3:GetObject", f"arn:aws:s3:::cdk-hnb659fds-assets-{ACCOUNT}-{REGION}/another.zip"),
        Request("iam:PassRole", "*"),
    ]


def test_a_node_can_do_nothing_beyond_its_needs(deployed, world):
    gate, _ = world
    documents = gate.role_documents(deployed.role)
    allowed = [f"{r.action} {r.resource}" for r in beyond_its_needs(deployed) if evaluate(documents, r).allowed]
    assert allowed == []


def _physical(deployed: Deployed, ref: dict) -> str:
    summaries = boto3.client("cloudformation").list_stack_resources(StackName=deployed.stack)["StackResourceSummaries"]
    return next(r["PhysicalResourceId"] for r in summaries if r["LogicalResourceId"] == ref["Ref"])


USER_POLICY = REPO / "docs" / "user-policy.json"
HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHostKeyPublishedByRankZero gpu-cluster-host"
# What each fab task that calls AWS asks of it, in the order a user runs them (release-spot on Spot only).
LAPTOP_TASKS = ("preflight", "cost", "inventory", "status-aws", "stop-cluster", "release-spot", "start", "audit")


BUDGET = (
    "from pathlib import Path; from clusterops.inventory import Inventory; "
    "from clusterops.run.meter import budget_price, efs_io_rate; inv = Inventory.load(Path({inventory!r})); "
    "print(f'price={{budget_price(inv)}} efs_rate={{efs_io_rate(inv)}}')"
)


def laptop_steps(deployed: Deployed, work) -> list[list[str]]:
    name, cluster = deployed.stack, deployed.context["cluster_name"]
    # the deploy's own -c values, its key pair too (moto_deploy names one: moto makes no ED25519 pair)
    as_deployed = {"key_name": deployed.key_file.stem, **deployed.context}
    context = [*MOTO_LIMITS, *(a for k, v in as_deployed.items() for a in ("-c", f"{k}={v}"))]
    steps = {
        "preflight": ["preflight", *context],
        "cost": ["cost"],
        "inventory": ["inventory", "--stack", name, "--from-aws", "--key-file", str(deployed.key_file)],
        "stop-cluster": ["stop-cluster"],
        "release-spot": ["release-spot", "--cluster", cluster] if deployed.context.get("spot") else None,
        "start": ["start"],
        "audit": ["audit", "--cluster", cluster],
    }
    return [s for s in steps.values() if s]


# Granted for what these laptop runs do not call: `cdk deploy`/`destroy` assume the CDK bootstrap's roles;
# Session Manager's actions are the SSH proxy's with access=ssm (test_session_manager_reaches_...);
# preflight reads a given VPC's DNS attributes and its subnet's routes (test_a_given_vpc_without_dns_...,
# test_a_given_subnet_without_a_way_out_...).
USED_ELSEWHERE = {"sts:AssumeRole", "ssm:StartSession", "ssm:TerminateSession", "ssm:ResumeSession"}
USED_ELSEWHERE |= {"ssmmessages:OpenDataChannel"}  # the plugin's data channel (a WebSocket, not the gate's)
USED_ELSEWHERE |= {"ec2:DescribeVpcAttribute", "ec2:DescribeSubnets", "ec2:DescribeRouteTables"}
# preflight counts a region's VPCs and internet gateways for a new cluster (test_a_region_without_a_vpc_left_...).
USED_ELSEWHERE |= {"ec2:DescribeVpcs", "ec2:DescribeInternetGateways"}
# and, with a customer managed default EBS key, its grants (test_a_customer_managed_default_ebs_key_...).
USED_ELSEWHERE |= {"kms:ListGrants"}
# a node type outside the table already running (test_a_running_type_outside_the_table_counts_...), and the grant
# EC2 makes on `fab start`'s behalf for a customer managed default EBS key (test_a_start_of_nodes_whose_root_...).
USED_ELSEWHERE |= {"ec2:DescribeInstanceTypes", "kms:CreateGrant"}
USED: set[str] = set()


@pytest.mark.parametrize("deployed", ["default", "spot"], indirect=True)
def test_the_laptops_calls_are_allowed_by_the_documented_user_policy(deployed, world, tmp_path):
    USED.update(laptop_tasks(deployed, world, tmp_path))


def test_the_documented_user_policy_grants_no_action_that_fab_does_not_call():
    if not USED:
        pytest.skip("runs after the laptop rehearsal")  # not selected alone
    policy = json.loads(USER_POLICY.read_text())
    granted = {a for s in policy["Statement"] for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    assert granted - USED - USED_ELSEWHERE == set()


def user_env(world, name: str, tmp_path) -> dict:
    """The laptop's environment under the documented user policy, as the IAM user `name`."""
    gate, endpoint = world
    return {
        **gate.user(name, [json.loads(USER_POLICY.read_text())]),
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_REGION": REGION,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_CONFIG_FILE": "/dev/null",
        "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
        "GPU_CLUSTER_INVENTORY": str(tmp_path / "inventory.json"),
        "GPU_CLUSTER_CDK_CONTEXT": str(tmp_path / "cdk.context.json"),
    }


def publish_host_key(deployed: Deployed) -> None:
    """What rank 0's bootstrap writes (test_every_node_boots_... runs it for real), for `fab inventory`."""
    host_key = f"/gpu-cluster/{deployed.context['cluster_name']}/ssh-host-key"
    if boto3.client("ssm").get_parameter(Name=host_key)["Parameter"]["Value"].startswith("pending"):
        boto3.client("ssm").put_parameter(Name=host_key, Value=HOST_KEY, Type="String", Overwrite=True)


def laptop_tasks(deployed: Deployed, world, tmp_path) -> set[str]:
    """Each fab task that calls AWS, under the documented user policy; returns the actions they called."""
    gate, _ = world
    env = user_env(world, f"user-{deployed.name}", tmp_path)
    # The project the deploy ran in: its cdk.context.json (the AMI and AZ pins), which preflight reads again.
    shutil.copy(deployed.key_file.parent / "app" / "cdk.context.json", env["GPU_CLUSTER_CDK_CONTEXT"])
    publish_host_key(deployed)
    cluster = deployed.context["cluster_name"]
    if not boto3.client("cloudwatch").describe_alarms(AlarmNamePrefix=cluster)["MetricAlarms"]:
        # Each node's idle alarm, as the template's IdleAlarmN creates it (moto's stack leaves it out): the
        # audit lists it, reading its tags under the user policy.
        idle_alarm(f"{cluster}-node0-idle", cluster)
    # A user's day starts with the cluster running (the boot rehearsal's --stop-now may have stopped it on this
    # worker first): so `fab stop-cluster` has nodes to stop, as it has on AWS.
    boto3.client("ec2").start_instances(InstanceIds=deployed.instances)
    if deployed.context.get("spot"):
        # The persistent request a Spot node's launch template leaves on EC2 (moto's launch makes none),
        # its node stopped as `fab stop-cluster` stops the cluster's.
        request = persistent_spot_request(deployed.context["cluster_name"])
        boto3.client("ec2").stop_instances(InstanceIds=[request["InstanceId"]])
    before = len(gate.calls)
    outputs = []
    preflight = ""
    for step in laptop_steps(deployed, tmp_path):
        done = run_fab(*step, **env)
        preflight = preflight or done.stdout
        outputs.append(f"$ fab {' '.join(step)} -> {done.returncode}\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
    # fab train --budget-usd on this inventory: the price it meters at and the EFS I/O rate it reads.
    outputs.append(node_program(["-c", BUDGET.format(inventory=env["GPU_CLUSTER_INVENTORY"])], env))
    assert "price=" in outputs[-1] and "efs_rate=" in outputs[-1], outputs[-1]
    # preflight found the deployed stack from its own outputs, and the same -c values change none of its nodes
    found = f"deployed cluster: {deployed.stack} ("
    assert found in preflight and "changes none of its nodes by type" in preflight, preflight
    ours = [c for c in gate.calls[before:] if c.principal == f"user-{deployed.name}"]
    print("\n".join(outputs))
    assert [v for v in gate.violations if v.startswith(f"user-{deployed.name}")] == [], "\n".join(outputs)
    return {c.action for c in ours}


# The Session Manager plugin's stand-in: it records what the AWS CLI hands it, and the session ends at once.
PLUGIN = """#!/bin/sh
[ "$1" = --version ] && { echo 1.2.707.0; exit 0; }
printf '%s\\n' "$*" >> "$SESSIONS_LOG"
"""
SHELL_SESSION = "aws ssm start-session --target i-"  # how docs/operations.md has you read a node's boot log


@pytest.mark.parametrize(
    "deployed", [pytest.param("p4d-efa", marks=pytest.mark.xdist_group("rehearsal-p4d-efa"))], indirect=True
)
def test_session_manager_reaches_every_node_under_the_documented_user_policy(deployed, world, tmp_path):
    """access=ssm, as the real AWS CLI runs it under docs/user-policy.json: `fab inventory`, then each node's
    SSH proxy command from the inventory (AWS-StartSSHSession) and the checklist's shell session start a
    session; without the plugin the CLI ends its session itself (TerminateSession); an instance without the
    cluster's tag is refused."""
    gate, _ = world
    publish_host_key(deployed)
    env = {**user_env(world, "user-sessions", tmp_path), "SESSIONS_LOG": str(tmp_path / "sessions.log")}
    plugin = tmp_path / "bin" / "session-manager-plugin"
    plugin.parent.mkdir()
    plugin.write_text(PLUGIN)
    plugin.chmod(0o755)
    inventory = run_fab(
        "inventory", "--stack", deployed.stack, "--from-aws", "--key-file", str(deployed.key_file), **env
    )
    assert inventory.returncode == 0, inventory.stdout + inventory.stderr
    nodes = Inventory.load(Path(env["GPU_CLUSTER_INVENTORY"]))
    with_plugin = tool_env(**env, PATH=f"{plugin.parent}:{tool_env()['PATH']}")
    for node in nodes.nodes:
        shell = f"aws ssm start-session --target {node.public_ip}"
        for line in (nodes.ssh.proxy_for(node.public_ip), shell):
            done = subprocess.run(["bash", "-c", line], env=with_plugin, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{line}: {done.stdout}{done.stderr}"
    assert SHELL_SESSION in (REPO / "docs" / "operations.md").read_text()
    started = (tmp_path / "sessions.log").read_text().splitlines()
    assert len(started) == 2 * len(deployed.instances) and all("StartSession" in s for s in started), started
    assert sum("AWS-StartSSHSession" in s and "4444" in s for s in started) == len(deployed.instances)
    no_plugin = subprocess.run(
        ["bash", "-c", f"aws ssm start-session --target {deployed.instances[0]}"],
        env=tool_env(**env), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "SessionManagerPlugin is not found" in no_plugin.stderr
    ours = [c for c in gate.calls if c.principal == "user-sessions"]
    assert [v for v in gate.violations if v.startswith("user-sessions:")] == []
    assert {"ssm:StartSession", "ssm:TerminateSession"} <= {c.action for c in ours}
    # The plugin then opens the session's data channel (AWS's quickstart end-user policy grants it on the
    # user's own sessions): allowed on each session this user started, not on another user's.
    policy = [json.loads(USER_POLICY.read_text())]
    for session in [s for s in gate.sessions if s.startswith("user-sessions-")] + ["someone-else-0"]:
        arn = f"arn:aws:ssm:{REGION}:{ACCOUNT}:session/{session}"
        opened = evaluate(policy, Request("ssmmessages:OpenDataChannel", arn, {"aws:username": "user-sessions"}))
        assert opened.allowed == session.startswith("user-sessions-"), (session, opened.reason)
    untagged = untagged_instance()
    refused = subprocess.run(
        ["bash", "-c", f"aws ssm start-session --target {untagged}"],
        env=with_plugin, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode != 0 and "AccessDenied" in refused.stderr, refused.stderr
    boto3.client("ec2").terminate_instances(InstanceIds=[untagged])


def untagged_instance() -> str:
    """An instance in the account that is not the cluster's (no gpu-cluster:name tag)."""
    ec2 = boto3.client("ec2")
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    return ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
