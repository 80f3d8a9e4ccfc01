"""`fab destroy` (clusterops/aws/destroy.py): `cdk destroy` deletes the stack's EFS and every run on /data with
it, so it is refused in one line while a run goes, while /data holds runs never fetched or changed since (the
node program `cluster_node.programs.runs at-risk` tells, on the head node: here one real sshd), or while the
head node cannot be reached; a retained file system (retain_data=true) loses nothing. tests/test_moto.py runs
the real `cdk destroy` it then starts, against a stack deployed into the moto server."""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber
from conftest import REPO, run_fab
from one_sshd import free_port, needs_root_and_sshd, serve

from cluster_node.protocol import rundir
from cluster_node.protocol.contract import RETAIN_TAG
from clusterops.aws import destroy
from clusterops.inventory import Inventory, Node, SshSettings, write_known_hosts
from clusterops.nodes.records import AtRisk

_LAUNCHERS: list[subprocess.Popen] = []


def _launcher() -> subprocess.Popen:
    """A live process that is a supervisor by its command line (cluster_node.programs.runs.alive), for the
    session; a pid alone (this test's) is not one: a new container may have given it to another process."""
    if not _LAUNCHERS:
        module = "cluster_node.supervisor.loop"
        _LAUNCHERS.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)", module]))
        atexit.register(_LAUNCHERS[0].kill)
        cmdline = Path(f"/proc/{_LAUNCHERS[0].pid}/cmdline")
        deadline = time.monotonic() + 10
        while module.encode() not in cmdline.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)  # until the child has exec'd: before, its command line is this process's
    return _LAUNCHERS[0]


def _runs(data, fetched=(), unfetched=(), active=None) -> None:
    """Run directories with a checkpoint each; `fetched` ones with fab fetch's marker after it; `active` named
    by runs/.active with a live launcher (a process whose command line names the supervisor's module)."""
    for name in (*fetched, *unfetched, *([active] if active else [])):
        checkpoints = data / rundir.RUNS / name / rundir.CHECKPOINTS
        checkpoints.mkdir(parents=True, exist_ok=True)
        (checkpoints / rundir.CHECKPOINT.format(step=10)).write_bytes(b"weights")
    later = time.time() + 5
    for name in fetched:
        marker = data / rundir.RUNS / name / rundir.FETCHED
        marker.touch()
        os.utime(marker, (later, later))
    if active:
        (data / rundir.RUNS / active / rundir.LAUNCHER_PID).write_text(str(_launcher().pid))
        rundir.active_file(data).write_text(str(data / rundir.RUNS / active))


def test_the_node_program_names_the_run_going_and_the_runs_not_fetched(tmp_path):
    _runs(tmp_path, fetched=["kept"], unfetched=["lost"], active="going")
    command = [sys.executable, "-m", "cluster_node.programs.runs", "at-risk", "--data", str(tmp_path)]
    found = json.loads(subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO).stdout)
    assert found == {"active": "going", "unfetched": ["going", "lost"]}
    (tmp_path / rundir.RUNS / "going" / rundir.LAUNCHER_PID).write_text("999999999")  # its launcher is gone
    found = json.loads(subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO).stdout)
    assert found["active"] is None


def test_a_live_pid_is_a_runs_launcher_only_as_the_supervisor(tmp_path):
    """A head container started again numbers its processes from 1: the pid in launcher.pid may be another
    process's now (this test's own here), and the run is not going."""
    from cluster_node.programs import runs, start

    _runs(tmp_path, active="going")
    assert runs.alive(tmp_path / rundir.RUNS / "going") and start.going(rundir.active_file(tmp_path))
    (tmp_path / rundir.RUNS / "going" / rundir.LAUNCHER_PID).write_text(str(os.getpid()))
    assert not runs.alive(tmp_path / rundir.RUNS / "going") and start.going(rundir.active_file(tmp_path)) is None


def test_a_retained_file_system_loses_no_run_but_a_run_going_still_ends_with_the_nodes():
    inventory = _inventory_of(None, 22, None)
    assert destroy.refusal(inventory, lambda: AtRisk(None, ("r1",)), kept=True) is None
    assert "is going" in (destroy.refusal(inventory, lambda: AtRisk("r2", ()), kept=True) or "")
    assert destroy.refusal(inventory, lambda: AtRisk(None, ()), kept=False) is None


def _inventory_of(tmp_path, port: int, file_system: str | None) -> Inventory:
    root = tmp_path or REPO
    return Inventory(
        cluster="doomed",
        source="aws",
        nodes=[Node(rank=0, name="node0", public_ip="127.0.0.1", private_ip="127.0.0.1")],
        gpus_per_node=1,
        ssh=SshSettings("root", port, str(root / "client"), str(root / "known_hosts")),
        data_dir=str(root / "data"),
        python=sys.executable,
        code_dir=str(REPO / "assets" / "train"),
        region="us-east-1",
        stack_name="GpuCluster-doomed",
        file_system_id=file_system,
    )


def _file_system(retain: bool) -> str:
    tags = [{"Key": "gpu-cluster:name", "Value": "doomed"}] + ([{"Key": RETAIN_TAG, "Value": "true"}] if retain else [])
    return boto3.client("efs").create_file_system(CreationToken=f"doomed-{retain}-{time.time()}", Tags=tags)[
        "FileSystemId"
    ]


def _destroy(path, aws_env, *args):
    return run_fab("destroy", *args, GPU_CLUSTER_INVENTORY=str(path), **aws_env)


def _stack(name: str) -> None:
    """A stack of that name in the moto server (what it holds does not matter to the refusals)."""
    template = {"Resources": {"Handle": {"Type": "AWS::CloudFormation::WaitConditionHandle"}}}
    boto3.client("cloudformation").create_stack(StackName=name, TemplateBody=json.dumps(template))


@needs_root_and_sshd
def test_destroy_is_refused_while_data_would_be_lost_and_says_what_to_run(tmp_path, aws_env):
    path = tmp_path / "inventory.json"
    _stack("GpuCluster-doomed")
    with serve(tmp_path) as port:
        write_known_hosts(tmp_path / "known_hosts", ["127.0.0.1"], (tmp_path / "host.pub").read_text(), port)
        _inventory_of(tmp_path, port, _file_system(retain=False)).save(path)
        _runs(tmp_path / "data", fetched=["kept"], unfetched=["lost"])
        refused = _destroy(path, aws_env)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr
        assert refused.stderr.strip() == (
            "error: /data holds runs never fetched or changed since: lost; the file system goes with the stack: "
            "`fab fetch --run NAME` each, or `fab destroy --yes` destroys anyway"
        )
        assert "$ " not in refused.stdout  # no `cdk destroy` started
        _runs(tmp_path / "data", fetched=["kept", "lost"], active="going")
        going = _destroy(path, aws_env)
        assert going.returncode == 1 and going.stderr.strip().startswith("error: run going is going: `fab stop --run")
    _inventory_of(tmp_path, free_port(), _file_system(retain=True)).save(path)  # nothing listens there
    stopped = _destroy(path, aws_env)
    assert stopped.returncode == 1 and stopped.stderr.strip().startswith("error: no node answered (")
    assert "a stopped cluster needs `fab start`" in stopped.stderr and len(stopped.stderr.strip().splitlines()) == 1
    boto3.client("cloudformation").delete_stack(StackName="GpuCluster-doomed")
    gone = _destroy(path, aws_env)  # destroyed already: nothing to read or run
    assert gone.returncode == 0 and gone.stdout.startswith("no stack GpuCluster-doomed in us-east-1: nothing to")


def test_a_spot_node_outside_the_inventory_stops_the_destroy_in_one_line_with_the_commands(tmp_path, aws_env):
    """A persistent request launches a new node when its node is terminated: the inventory does not list it,
    `fab destroy` cannot stop it, and `cdk destroy` would leave it billing. Before: release_spot's
    InventoryError escaped `fab destroy` as a traceback."""
    from test_audit import persistent_spot_request

    _stack("GpuCluster-doomed")
    request = persistent_spot_request("doomed")
    image = request["LaunchSpecification"]["ImageId"]
    listed = boto3.client("ec2").run_instances(ImageId=image, MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    node = dataclasses.replace(_inventory_of(tmp_path, 22, None).nodes[0], instance_id=listed)
    path = tmp_path / "inventory.json"
    (tmp_path / "known_hosts").write_text("")
    dataclasses.replace(_inventory_of(tmp_path, 22, None), spot=True, nodes=[node]).save(path)
    refused = _destroy(path, aws_env, "--yes")
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        f"error: {request['InstanceId']} of the cluster's Spot requests still run(s), not in the inventory: cancel "
        "the requests, then terminate the node(s) (`aws ec2 cancel-spot-instance-requests --region us-east-1 "
        f"--spot-instance-request-ids {request['SpotInstanceRequestId']}`, then `aws ec2 terminate-instances "
        f"--region us-east-1 --instance-ids {request['InstanceId']}`), then `fab destroy --yes` (/data was checked "
        "before the inventory's nodes were stopped); nothing cancelled or destroyed"
    ]
    assert f"stopped {node.instance_id}" in refused.stdout and "$ " not in refused.stdout  # no `cdk destroy` started
    requests = boto3.client("ec2").describe_spot_instance_requests()["SpotInstanceRequests"]
    assert [r["State"] for r in requests if r["SpotInstanceRequestId"] == request["SpotInstanceRequestId"]] != [
        "cancelled"
    ]
    assert boto3.client("cloudformation").describe_stacks(StackName="GpuCluster-doomed")["Stacks"]
    boto3.client("cloudformation").delete_stack(StackName="GpuCluster-doomed")


def test_a_stopped_cluster_that_keeps_its_file_system_is_destroyed_without_starting_a_node(tmp_path, aws_env):
    """retain_data=true keeps /data, and a cluster whose every node is stopped runs nothing: no node need answer.
    Before: refused with "a stopped cluster needs `fab start`", a start of every GPU node, billed, to read /data."""
    ec2 = boto3.client("ec2")
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    node_id = ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    _stack("GpuCluster-doomed")
    clients = {name: boto3.client(name) for name in ("cloudformation", "efs", "ec2")}

    def unreachable():
        raise ConnectionRefusedError("nothing listens")

    def attempt(retain: bool) -> str:
        base = _inventory_of(tmp_path, free_port(), _file_system(retain=retain))
        inventory = dataclasses.replace(base, nodes=[dataclasses.replace(base.nodes[0], instance_id=node_id)])
        with pytest.raises(destroy.DestroyError) as refused:
            destroy.destroy(inventory, clients, unreachable, tmp_path, yes=False, say=lambda line: None)
        return str(refused.value)

    assert attempt(retain=True).startswith("no node answered (")  # running: a run may be going
    ec2.stop_instances(InstanceIds=[node_id])
    assert attempt(retain=False).startswith("no node answered (")  # /data goes with the stack: unread
    assert attempt(retain=True).startswith("no pinned CDK CLI in ")  # past the check: tmp_path has no CLI
    boto3.client("cloudformation").delete_stack(StackName="GpuCluster-doomed")


def test_nodes_still_stopping_are_waited_for_not_started():
    """`fab stop-cluster; fab destroy`: a GPU node can stay `stopping` for minutes; the destroy waits for it
    instead of asking for a `fab start`. A node that stops failing, or one running, is a no."""
    ec2 = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    inventory = dataclasses.replace(
        _inventory_of(None, 22, None),
        nodes=[dataclasses.replace(_inventory_of(None, 22, None).nodes[0], instance_id="i-1")],
    )

    def described(state: str) -> dict:
        return {"Reservations": [{"Instances": [{"InstanceId": "i-1", "State": {"Name": state, "Code": 0}}]}]}

    with Stubber(ec2) as stubber:
        for state in ("stopping", "stopping", "stopped", "running", "stopping", "terminated"):
            stubber.add_response("describe_instances", described(state))
        assert destroy.all_stopped(inventory, ec2, delay=0) is True  # stopping, then the waiter: stopping, stopped
        assert destroy.all_stopped(inventory, ec2, delay=0) is False  # running
        assert destroy.all_stopped(inventory, ec2, delay=0) is False  # stopping, then gone: the waiter fails
        stubber.assert_no_pending_responses()


def test_the_destroy_command_names_the_stack_and_only_the_context_that_names_it():
    inventory = _inventory_of(None, 22, None)
    argv = destroy.command(inventory, REPO)
    assert argv[1:] == ["destroy", "GpuCluster-doomed", "--force", "-c", "cluster_name=doomed"] + [
        "-c",
        "stack_name=GpuCluster-doomed",  # always: a stack_name in cdk.json or ~/.cdk.json must not win
    ]
    assert argv[0] == str(REPO / "node_modules" / ".bin" / "cdk")  # the pinned CLI, not npx's newest
    renamed = dataclasses.replace(inventory, stack_name="Team-Cluster")
    assert destroy.command(renamed, REPO)[-4:] == ["-c", "cluster_name=doomed", "-c", "stack_name=Team-Cluster"]
    with pytest.raises(destroy.DestroyError, match="no pinned CDK CLI in .*`bash scripts/setup.sh`"):
        destroy.command(inventory, REPO / "tests")


def test_an_older_images_node_program_is_a_fab_sync_not_a_stopped_cluster():
    def older():
        raise destroy.UnansweredError("node0: `python -m cluster_node.programs.runs at-risk` exited 2: invalid choice")

    why = destroy.refusal(_inventory_of(None, 22, None), older, kept=False) or ""
    assert why.startswith("the nodes could not say what /data holds (") and "`fab sync`, then `fab destroy`" in why


def test_a_missing_cdk_cli_leaves_a_spot_clusters_requests_open_and_its_nodes_running(aws_env):
    """A cancelled request never stops its instance again (EC2 User Guide, *Cancel a Spot Instance request*):
    the CLI is checked before the Spot step stops the nodes and cancels their requests."""
    _stack("GpuCluster-doomed")
    ec2 = boto3.client("ec2")
    stubber = Stubber(ec2)  # nothing queued: any EC2 call fails the test
    inventory = dataclasses.replace(_inventory_of(None, 22, None), spot=True)
    clients = {"cloudformation": boto3.client("cloudformation"), "efs": boto3.client("efs"), "ec2": ec2}
    with stubber, pytest.raises(destroy.DestroyError, match="no pinned CDK CLI"):
        destroy.destroy(inventory, clients, lambda: AtRisk(None, ()), REPO / "tests", yes=True)
    stubber.assert_no_pending_responses()
