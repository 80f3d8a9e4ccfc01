"""The autostop watchdog and its safety net: the decision on recorded observations, the CloudWatch
alarm as the template defines it (evaluated on the recorded heartbeat), the stop action and the
heartbeat against a moto server, the region from instance metadata, and --then-stop from the
environment the launcher really has (an SSH session: no AWS variables)."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Optional

import aws_cdk as cdk
import boto3
import pytest
from aws_cdk.assertions import Match, Template
from conftest import REPO, mark_ready, moto_instances, tool_env
from supervisor_fixture import supervise, write_spec

from cluster_node.daemons.autostop import busy_signals as signals
from cluster_node.daemons.autostop import cloud
from cluster_node.daemons.autostop import watchdog as autostop
from cluster_node.daemons.autostop.idle_state import IdleState
from cluster_node.daemons.autostop.watchdog import Observation, Watchdog, decide
from cluster_node.protocol import spec
from clusterops.inventory import Inventory, Node, SshSettings
from clusterops.run import dataprep, launch
from stacks.cluster_stack import GpuClusterStack
from stacks.config import ALARM_GRACE_MINUTES, MAX_IDLE_MINUTES, ClusterConfig, alarm_minutes
from train import prepare

MIN = 60.0


def _template(**context) -> Template:
    config = ClusterConfig.from_context({"ssh_cidr": "203.0.113.0/24", "ami_id": "ami-0123456789abcdef0", **context})
    return Template.from_stack(GpuClusterStack(cdk.App(), "Cluster", config=config))


def idle_alarm(**context) -> dict:
    alarms = _template(**context).find_resources("AWS::CloudWatch::Alarm")
    return next(iter(alarms.values()))["Properties"]


def alarm_fires_at(alarm: dict, series: dict[str, list[Optional[float]]]) -> Optional[int]:
    """The minute at which CloudWatch would put the alarm into ALARM, evaluating per-minute values
    (None: nothing published) exactly as the alarm's properties say."""
    values = series[alarm["MetricName"]]
    period = alarm["Period"] // 60
    n, m = alarm["EvaluationPeriods"], alarm.get("DatapointsToAlarm", alarm["EvaluationPeriods"])
    breaching_if_missing = alarm.get("TreatMissingData") == "breaching"
    compare = {
        "LessThanThreshold": lambda v: v < alarm["Threshold"],
        "GreaterThanThreshold": lambda v: v > alarm["Threshold"],
    }[alarm["ComparisonOperator"]]
    points = []
    for start in range(0, len(values) - period + 1, period):
        chunk = [v for v in values[start : start + period] if v is not None]
        value = (max(chunk) if alarm["Statistic"] == "Maximum" else sum(chunk) / len(chunk)) if chunk else None
        points.append(breaching_if_missing if value is None else compare(value))
        if len(points) >= n and sum(points[-n:]) >= m:
            return start + period
    return None


def replay(observations: list[Observation], idle: float, peers=lambda t: ()) -> tuple[list[float], Optional[float]]:
    """The watchdog's decisions on recorded observations: (heartbeat per sample, stop time or None)."""
    dog, beats = Watchdog(idle, MIN), []
    for seen in observations:
        reasons, decision = dog.tick(seen, peers(seen.time))
        beats.append(1.0 if reasons else 0.0)
        if decision.stop:
            return beats, seen.time
    return beats, None


# ---------------------------------------------------------------- issue item 1: idle, really idle


def training_at_low_cpu(minutes: int, step_every: int = 3) -> list[Observation]:
    """A CPU-only rank (2% of the instance's CPU, no GPU reading) writing progress every 3 minutes."""
    return [
        Observation(time=(t + 1) * MIN, step=100 + t // step_every, progress_age_s=(t % step_every) * MIN)
        for t in range(minutes)
    ]


def test_a_node_at_2_percent_cpu_with_a_training_step_advancing_is_never_stopped():
    minutes = 6 * 60
    beats, stopped = replay(training_at_low_cpu(minutes), idle=60)
    assert stopped is None and beats == [1.0] * minutes
    alarm = idle_alarm(idle_minutes="60")
    assert alarm_fires_at(alarm, {"CPUUtilization": [2.0] * minutes, alarm["MetricName"]: beats}) is None


def test_a_node_whose_watchdog_died_is_stopped_within_the_documented_time():
    idle, died = 60, 90
    alarm = idle_alarm(idle_minutes=str(idle))
    assert alarm["Namespace"] == autostop.NAMESPACE and alarm["MetricName"] == autostop.METRIC
    assert alarm["TreatMissingData"] == "breaching"
    heartbeat = [1.0] * died + [None] * (24 * 60)  # the watchdog publishes nothing after minute 90
    fired = alarm_fires_at(alarm, {"CPUUtilization": [2.0] * len(heartbeat), alarm["MetricName"]: heartbeat})
    assert fired is not None and fired - died == alarm_minutes(idle) == idle + ALARM_GRACE_MINUTES
    # The longest idle_minutes still fits CloudWatch's limit: period x evaluation periods <= 1 day.
    longest = idle_alarm(idle_minutes=str(MAX_IDLE_MINUTES))
    assert longest["Period"] * longest["EvaluationPeriods"] <= 24 * 3600


def test_an_idle_node_is_stopped_by_the_watchdog_first_then_by_its_alarm():
    idle = 45
    idle_minutes = [Observation(time=(t + 1) * MIN, gpu_util=0.0) for t in range(4 * 60)]
    beats, stopped = replay(idle_minutes, idle=idle)
    assert stopped == pytest.approx((idle + 2 + 1) * MIN, abs=MIN)  # two startup beats, then idle_minutes
    alarm = idle_alarm(idle_minutes=str(idle))
    fired = alarm_fires_at(alarm, {alarm["MetricName"]: beats + [0.0] * 200})
    assert fired == 2 + alarm_minutes(idle)


@pytest.mark.parametrize(
    "name, observation, busy",
    [
        ("GPU busy with no run going: your own work", Observation(MIN, gpu_util=95.0), True),
        (
            "a hung collective of a marked run: GPUs at 100%, no step for 40 min",
            Observation(MIN, step=500, progress_age_s=40 * MIN, gpu_util=100.0, run_live=True),
            False,
        ),
        (
            "GPU work after a failed run (its progress.json never says ended)",
            Observation(MIN, step=500, progress_age_s=40 * MIN, gpu_util=100.0),
            True,
        ),
        ("data being prepared", Observation(MIN, preparing=("prepare.py wmt16-en-de on node0",)), True),
        ("someone typing in a shell", Observation(MIN, terminals=("terminal pts/0 (input 3 min ago)",)), True),
        ("a run launched, no step yet", Observation(MIN, run_live=True, launching="run r launched 2 min ago"), True),
        ("step stuck for 40 min, GPUs idle", Observation(MIN, step=500, progress_age_s=40 * MIN, gpu_util=1.0), False),
        ("no run, no GPU", Observation(MIN), False),
    ],
)
def test_what_counts_as_busy(name, observation, busy):
    assert bool(autostop.local_reasons(observation, None)) is busy, name


def recorded(samples: list[tuple[float, tuple[str, ...], Optional[int]]]) -> IdleState:
    """The idle clock after these (time, reasons, step) samples."""
    state = IdleState("boot", since=samples[0][0], last=samples[0][0])
    for when, reasons, step in samples:
        state.record(when, list(reasons), step)
    return state


@pytest.mark.parametrize(
    "name, history, idle, stop",
    [
        ("busy throughout", [(t * MIN, ("GPU 90% busy",), None) for t in range(1, 62)], 60, False),
        ("idle for the whole window", [(t * MIN, (), 500) for t in range(1, 62)], 60, True),
        ("idle but not for long enough", [(t * MIN, (), None) for t in range(1, 31)], 60, False),
        ("busy once inside the window", [(t * MIN, ("x",) if t == 50 else (), None) for t in range(1, 62)], 60, False),
        ("disabled", [(t * MIN, (), None) for t in range(1, 200)], 0, False),
        (
            "a 20-minute silence: nobody watched",
            [(t * MIN, (), 500) for t in [*range(1, 40), *range(60, 100)]],
            60,
            False,
        ),
    ],
)
def test_decision_on_recorded_samples(name, history, idle, stop):
    decision = decide(recorded(history), idle, now=history[-1][0])
    assert decision.stop is stop, (name, decision.reason)
    if stop:
        assert f"idle for {idle:g} min: step stuck at 500" in decision.reason


def test_a_dead_head_node_does_not_keep_the_workers_running(tmp_path):
    """Every node runs a watchdog; a peer's heartbeat counts only while it is fresh."""
    beat = tmp_path / ".cluster" / "heartbeat"
    autostop.share(tmp_path, "0", now=1000.0, reasons=["training step 7 advancing"])
    assert autostop.peer_reasons(tmp_path, "1", now=1000.0 + 2 * MIN, fresh_s=3 * MIN) == [
        "node0: training step 7 advancing"
    ]
    assert autostop.peer_reasons(tmp_path, "1", now=1000.0 + 10 * MIN, fresh_s=3 * MIN) == []
    assert autostop.peer_reasons(tmp_path, "0", now=1000.0, fresh_s=3 * MIN) == []  # not its own
    assert [p.name for p in beat.iterdir()] == ["node0.json"]
    # Worker's view: the head trains for 2 hours, then dies; the worker stops the cluster idle_minutes later.
    head_busy_until = 120 * MIN
    observations = [Observation(time=(t + 1) * MIN) for t in range(6 * 60)]
    _, stopped = replay(observations, idle=30, peers=lambda now: ["node0: training"] if now <= head_busy_until else [])
    assert stopped == pytest.approx(head_busy_until + 30 * MIN, abs=2 * MIN)


# ---------------------------------------------------------------- issue item 3: data preparation


def test_data_preparation_keeps_a_fresh_marker_that_the_watchdog_counts(tmp_path):
    busy = tmp_path / ".cluster" / "busy"
    with prepare.busy_marker(str(busy), "prepare.py imagenet on node1", every=0.05):
        now = time.time()
        assert signals.preparing(tmp_path, now) == ("prepare.py imagenet on node1",)
        marker = next(busy.iterdir())
        first = marker.stat().st_mtime
        time.sleep(0.3)
        assert marker.stat().st_mtime > first  # refreshed while it runs
        os.utime(marker, (now - 10 * MIN, now - 10 * MIN))  # as if prepare.py had been killed long ago
        assert signals.preparing(tmp_path, now) == ()
        time.sleep(0.2)
    assert list(busy.iterdir()) == []  # removed at the end
    prepare.main(
        [
            "--busy-dir",
            str(busy),
            "numbers",
            "--out",
            str(tmp_path / "numbers"),
            "--train",
            "50",
            "--valid",
            "5",
            "--test",
            "5",
            "--vocab",
            "60",
        ]
    )
    assert list(busy.iterdir()) == []


def test_fab_data_passes_the_marker_directory():
    inv = Inventory(
        cluster="c",
        source="aws",
        gpus_per_node=1,
        nodes=[Node(0, "node0", "1.2.3.4", "10.0.0.5")],
        ssh=SshSettings("root", 4444, "/k", "/kh"),
    )
    argv = dataprep.prepare_argv(inv, "imagenet", "/workspace/train", ["--stage-to", "/opt/dlami/nvme/imagenet"])
    assert argv[:5] == ["env", "PYTHONPATH=/workspace", "python", "-m", "train.prepare"]
    assert argv[5:7] == ["--busy-dir", "/data/.cluster/busy"] and argv[7] == "imagenet"


# ---------------------------------------------------------------- issue items 2 and 8: the template


def test_the_role_may_stop_this_cluster_and_publish_the_heartbeat_even_with_autostop_off():
    for idle in ("0", "60"):
        template = _template(cluster_name="team-a", idle_minutes=idle)
        statements = json.dumps(template.to_json())
        template.has_resource_properties(
            "AWS::IAM::Policy",
            {
                "PolicyDocument": {
                    "Statement": Match.array_with(
                        [
                            Match.object_like(
                                {
                                    "Action": "ec2:StopInstances",
                                    "Effect": "Allow",
                                    "Condition": {"StringEquals": {"aws:ResourceTag/gpu-cluster:name": "team-a"}},
                                }
                            ),
                            Match.object_like(
                                {
                                    "Action": "cloudwatch:PutMetricData",
                                    "Effect": "Allow",
                                    "Condition": {"StringEquals": {"cloudwatch:namespace": autostop.NAMESPACE}},
                                }
                            ),
                        ]
                    )
                }
            },
        )
        assert "ec2:TerminateInstances" not in statements
        # The watchdog reads idle_minutes again from its parameter (issue 28 §1), with 0 too.
        reads = [
            statement
            for policy in template.find_resources("AWS::IAM::Policy").values()
            for statement in policy["Properties"]["PolicyDocument"]["Statement"]
            if "ssm:GetParameter" in statement["Action"]
        ]
        (parameter,) = [
            k
            for k, v in template.find_resources("AWS::SSM::Parameter").items()
            if v["Properties"]["Name"] == "/gpu-cluster/team-a/idle-minutes"
        ]
        assert any({"Ref": parameter} in r["Resource"]["Fn::Join"][1] for r in reads)
    _template(idle_minutes="0").resource_count_is("AWS::CloudWatch::Alarm", 0)


def test_one_minute_heartbeat_alarms_and_no_paid_detailed_monitoring():
    template = _template(nodes="3", idle_minutes="45")
    template.resource_count_is("AWS::CloudWatch::Alarm", 3)
    template.has_resource_properties(
        "AWS::CloudWatch::Alarm",
        {
            "Namespace": autostop.NAMESPACE,
            "MetricName": autostop.METRIC,
            "Statistic": "Maximum",
            "Period": 60,
            "EvaluationPeriods": 45 + 30,
            "DatapointsToAlarm": 45 + 30,
            "Dimensions": [{"Name": "InstanceId", "Value": Match.any_value()}],
            "AlarmActions": [{"Fn::Join": ["", Match.array_with([":ec2:stop"])]}],
        },
    )
    # 1-minute periods need a beat a minute: the interval entrypoint.sh leaves at its default.
    assert autostop.arguments().get_default("interval") == 60.0
    assert "--interval" not in (REPO / "assets" / "docker" / "entrypoint.sh").read_text()
    instances = template.find_resources("AWS::EC2::Instance")
    assert not [i for i in instances.values() if i["Properties"].get("Monitoring")]
    # It refers to its instance, so CloudFormation creates it only after the node signalled (the
    # creation policy): a bootstrap, with no heartbeat yet, cannot trip it.
    refs = {
        a["Properties"]["Dimensions"][0]["Value"]["Ref"]
        for a in template.find_resources("AWS::CloudWatch::Alarm").values()
    }
    assert refs == set(instances) and all(i.get("CreationPolicy") for i in instances.values())


def test_nothing_is_retained_by_default_and_retained_data_is_tagged():
    resources = _template().to_json()["Resources"].values()
    assert not [r for r in resources if r.get("DeletionPolicy") == "Retain"]
    retained = [
        r for r in _template(retain_data="true").to_json()["Resources"].values() if r.get("DeletionPolicy") == "Retain"
    ]
    assert [r["Type"] for r in retained] == ["AWS::EFS::FileSystem"]
    assert {"Key": "gpu-cluster:retain", "Value": "true"} in retained[0]["Properties"]["FileSystemTags"]


# ---------------------------------------------------------------- against a moto server


def test_stop_action_stops_only_this_clusters_running_instances(aws_env):
    ec2 = boto3.client("ec2")
    mine, other = moto_instances(2, "autostop-a"), moto_instances(1, "autostop-b")
    assert autostop.stop_cluster(ec2, "autostop-a") == sorted(mine)
    states = {
        i["InstanceId"]: i["State"]["Name"]
        for r in ec2.describe_instances(InstanceIds=mine + other)["Reservations"]
        for i in r["Instances"]
    }
    assert {states[i] for i in mine} <= {"stopping", "stopped"} and states[other[0]] == "running"
    assert autostop.stop_cluster(ec2, "autostop-a") == []  # nothing left running: no second stop call


def test_the_watchdog_loop_publishes_its_heartbeat_and_stops_an_idle_cluster(aws_env, tmp_path):
    ec2 = boto3.client("ec2")
    ids = moto_instances(2, "idle-loop")
    mark_ready(tmp_path, ids)
    (tmp_path / "runs" / "r").mkdir(parents=True)
    progress = tmp_path / "runs" / "r" / "progress.json"
    progress.write_text(json.dumps({"step": 120}))
    os.utime(progress, (time.time() - 3600, time.time() - 3600))  # stuck for an hour
    result = subprocess.run(
        [sys.executable, "-m", "cluster_node.daemons.autostop.watchdog", "--data", str(tmp_path), "--interval", "0.2"]
        + ["--pts", str(tmp_path / "no-terminals")],
        capture_output=True,
        text=True,
        timeout=60,
        env=tool_env(CLUSTER_NAME="idle-loop", IDLE_MINUTES="0.02", INSTANCE_ID=ids[0], NODE_RANK="1", **aws_env),
    )
    assert result.returncode == 0, result.stderr
    assert "idle for 0.02 min: step stuck at 120" in (tmp_path / ".cluster" / "autostop.log").read_text()
    states = {
        i["State"]["Name"] for r in ec2.describe_instances(InstanceIds=ids)["Reservations"] for i in r["Instances"]
    }
    assert states <= {"stopping", "stopped"}
    points = boto3.client("cloudwatch").get_metric_statistics(
        Namespace=autostop.NAMESPACE,
        MetricName=autostop.METRIC,
        Statistics=["Maximum", "Minimum"],
        Dimensions=[{"Name": "InstanceId", "Value": ids[0]}],
        Period=60,
        StartTime=time.time() - 600,
        EndTime=time.time() + 600,
    )["Datapoints"]
    assert points and max(p["Maximum"] for p in points) == 1.0 and min(p["Minimum"] for p in points) == 0.0
    assert json.loads((tmp_path / ".cluster" / "heartbeat" / "node1.json").read_text())["busy"] == []


def test_an_idle_clusters_stop_waits_while_a_deploy_bootstraps_a_new_node(aws_env, tmp_path):
    """`cdk deploy -c nodes=3` (or a replacement) on a cluster idle for most of idle_minutes: stopped
    mid-bootstrap, the new node would never signal and the deploy would roll back 45 minutes later. A node
    launched within the creation policy's window that no ready mark names holds the stop; once its mark is
    there, the idle cluster stops."""
    ec2 = boto3.client("ec2")
    ready, new = moto_instances(2, "idle-hold"), moto_instances(1, "idle-hold")
    mark_ready(tmp_path, ready)
    env = tool_env(CLUSTER_NAME="idle-hold", IDLE_MINUTES="0.005", INSTANCE_ID=ready[0], NODE_RANK="0", **aws_env)
    command = [sys.executable, "-m", "cluster_node.daemons.autostop.watchdog", "--data", str(tmp_path)]
    command += ["--interval", "0.2", "--pts", str(tmp_path / "no-terminals")]
    watchdog = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = tmp_path / ".cluster" / "autostop.log"
    deadline = time.time() + 30
    while "still bootstrapping" not in (log.read_text() if log.exists() else "") and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # five more rounds, each one idle
    states = lambda: {
        i["InstanceId"]: i["State"]["Name"]
        for r in ec2.describe_instances(InstanceIds=ready + new)["Reservations"]
        for i in r["Instances"]
    }
    assert f"idle, but not stopping: {new[0]} still bootstrapping" in log.read_text()
    assert set(states().values()) == {"running"} and watchdog.poll() is None
    (tmp_path / ".cluster" / "ready" / "node2").write_text(f"2026-11-27T00:10:00Z {new[0]}\n")
    assert watchdog.wait(timeout=30) == 0
    assert set(states().values()) <= {"stopping", "stopped"}
    assert cloud.bootstrapping(ec2, "idle-hold", set(), time.time() + cloud.BOOTSTRAP_HOLD_S) == []


@pytest.fixture
def imds(fake_imds):
    return fake_imds.url


def test_region_and_instance_from_the_environment_else_from_imdsv2(imds):
    assert autostop.instance_identity(imds)["region"] == "us-east-1"
    assert autostop.instance_identity("http://127.0.0.1:1", timeout=0.5) == {}
    no_region = {"PATH": "/usr/bin"}
    assert autostop.where_am_i(no_region, lambda: autostop.instance_identity(imds)) == (
        "us-east-1",
        "i-0123456789abcdef0",
    )
    assert autostop.where_am_i({"AWS_REGION": "eu-west-1", "INSTANCE_ID": "i-1"}, lambda: {}) == ("eu-west-1", "i-1")
    assert autostop.where_am_i(no_region, lambda: {}) == (None, None)


def launcher_env(aws_env: dict, imds_url: str) -> dict:
    """What an SSH session in the container has: PATH and HOME, and no AWS_* region. The moto
    endpoint and keys stand in for the instance role that botocore finds by itself on EC2."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "AWS_ENDPOINT_URL": aws_env["AWS_ENDPOINT_URL"],
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AUTOSTOP_IMDS_URL": imds_url,
    }


@pytest.mark.parametrize("inventory_region, imds_url", [("us-east-1", "http://127.0.0.1:1"), (None, "imds")])
def test_then_stop_stops_the_cluster_from_a_session_without_aws_variables(
    aws_env, tmp_path, imds, inventory_region, imds_url
):
    """The real supervisor and spec, as `fab train --then-stop` writes them for an AWS cluster."""
    cluster = f"thenstop-{inventory_region or 'imds'}"
    ids = moto_instances(2, cluster)
    inv = Inventory(
        cluster=cluster,
        source="aws",
        gpus_per_node=1,
        region=inventory_region,
        nodes=[Node(0, "node0", "198.51.100.1", "127.0.0.1", ids[0])],
        ssh=SshSettings("root", 4444, "/k", "/kh"),
        python=sys.executable,
        code_dir=str(REPO / "assets" / "train"),
        data_dir=str(tmp_path),
    )
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    written = launch.train_spec(inv, launch.TrainRequest(run="r", then_stop=True), "lo", inv.code_dir, dict(os.environ))
    assert written.then_stop is not None
    assert "AWS_DEFAULT_REGION" not in written.then_stop.env and "AWS_SECRET_ACCESS_KEY" not in written.then_stop.env
    run_spec = write_spec(run, ["bash", "-c", "echo 'run ended at step 10'"], ["127.0.0.1"], poll=0.2, cleanup=0.0)
    spec.write(run, dataclasses.replace(run_spec, then_stop=written.then_stop))
    result = supervise(run, env=launcher_env(aws_env, imds if imds_url == "imds" else imds_url), timeout=120)
    log = (run / "train.log").read_text()
    assert result.returncode == 0 and f"autostop: run ended; stopping {sorted(ids)}" in log, log
    states = {
        i["State"]["Name"]
        for r in boto3.client("ec2").describe_instances(InstanceIds=ids)["Reservations"]
        for i in r["Instances"]
    }
    assert states <= {"stopping", "stopped"}


def test_without_any_region_nothing_is_stopped_and_it_says_why_in_one_line(aws_env):
    env = launcher_env(aws_env, "http://127.0.0.1:1")
    result = subprocess.run(
        [sys.executable, "-m", "cluster_node.daemons.autostop.watchdog", "--stop-now"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(env, CLUSTER_NAME="x", PYTHONPATH=str(REPO / "assets")),  # as nodecmd's line sets it
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "autostop: no AWS region (AWS_REGION unset and no instance metadata); nothing stopped"
    ]


def test_the_newest_unfinished_run_is_the_one_that_counts(tmp_path):
    assert signals.latest_progress(tmp_path, 1000.0) == (None, None)
    for run, values, age in (("old", {"step": 10}, 900), ("new", {"step": 20}, 100)):
        (tmp_path / "runs" / run).mkdir(parents=True)
        path = tmp_path / "runs" / run / "progress.json"
        path.write_text(json.dumps(values))
        os.utime(path, (1000.0 - age, 1000.0 - age))
    assert signals.latest_progress(tmp_path, 1000.0) == (20, 100.0)
    (tmp_path / "runs" / "new" / "progress.json").write_text(json.dumps({"step": 30, "ended": "finished"}))
    assert signals.latest_progress(tmp_path, time.time()) == (None, None)  # a finished run is no run


def test_the_heartbeat_carries_gpu_utilisation_and_memory_for_the_dashboard(aws_env, tmp_path, monkeypatch):
    """nvidia-smi's CSV (a stand-in prints what a 2-GPU node prints) -> the metrics the dashboard plots."""
    from stacks.dashboard import GPU_METRICS, NODE_NAMESPACE

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '87, 6000, 15360'\necho '12, 1536, 15360'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    util, memory = signals.gpu_readings()
    assert util == 87.0 and memory == pytest.approx(100 * 6000 / 15360)
    cloudwatch = boto3.client("cloudwatch")
    autostop.publish(cloudwatch, "i-0dashboard", True, autostop.Observation(0.0, gpu_util=util, gpu_memory=memory))
    metrics = cloudwatch.list_metrics(
        Namespace=NODE_NAMESPACE, Dimensions=[{"Name": "InstanceId", "Value": "i-0dashboard"}]
    )["Metrics"]
    assert {m["MetricName"] for m in metrics} == {autostop.METRIC, *(name for name, _ in GPU_METRICS)}
    assert autostop.NAMESPACE == NODE_NAMESPACE
