"""The deploy timeline (issue 22 §6): the real node bootstrap, run in the sandbox (tests/bootstrap_sandbox.py),
times each of its steps into the node's local disk and, once ready, copies that to DATA/.cluster/deploy/nodeN,
where `fab status` reads it (cluster_node.programs.node_status)."""

import os

import pytest
from bootstrap_sandbox import Sandbox, host_paths

from cluster_node.programs import node_status

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a mount namespace"),
    pytest.mark.xdist_group("bootstrap-host-paths"),
]
STEPS = [
    "docker",
    "mount-efs",
    "image-context",
    "cluster-identity",
    "pull-image",
    "build-image",
    "start-container",
    "ready",
]


@pytest.fixture(scope="module", autouse=True)
def mountpoints():
    yield from host_paths()


def _lines(path):
    return [line.split() for line in path.read_text().splitlines()]


def test_a_deploy_times_every_step_in_order_and_publishes_the_timeline_on_data(tmp_path):
    sandbox = Sandbox(tmp_path, bare=True)  # a bare AMI: the docker step installs from apt
    result = sandbox.run()
    assert result.returncode == 0, result.stdout + result.stderr
    local = sandbox.root / "state" / "deploy-timeline"
    lines = _lines(local)
    assert [line[0] for line in lines] == STEPS
    times = [float(t) for line in lines for t in line[1:3]]
    assert times == sorted(times) and all(len(line) == 3 for line in lines)
    assert (sandbox.root / "efs" / ".cluster" / "deploy" / "node0").read_text() == local.read_text()
    calls = sandbox.calls()
    pull = calls.index("docker pull -q nvcr.io/nvidia/pytorch:24.12-py3")  # its own step, so it is timed
    assert pull < next(i for i, c in enumerate(calls) if c.startswith("docker build"))
    found = node_status.status(sandbox.root / "efs", "node0")["deploy"]
    assert [step for step, _, _ in found["steps"]] == STEPS
    assert found["total_s"] == pytest.approx(times[-1] - times[0], abs=0.01)


def test_a_failed_mount_leaves_the_timeline_with_the_failed_step_on_the_local_disk(tmp_path):
    sandbox = Sandbox(tmp_path)
    assert sandbox.run(FAIL_MOUNT="1", MOUNT_ATTEMPTS="2").returncode != 0
    lines = _lines(sandbox.root / "state" / "deploy-timeline")
    assert [line[0] for line in lines] == ["docker", "mount-efs"]
    assert lines[1][3:] == ["failed"] and float(lines[1][2]) >= float(lines[1][1])
    assert not (sandbox.root / "efs" / ".cluster" / "deploy").exists()


def test_a_second_run_times_itself_and_pulls_nothing_once_the_image_is_built(tmp_path):
    sandbox = Sandbox(tmp_path)
    assert sandbox.run().returncode == 0
    first = len(sandbox.calls())
    assert sandbox.run().returncode == 0
    assert not [c for c in sandbox.calls()[first:] if c.startswith("docker pull")]
    assert [line[0] for line in _lines(sandbox.root / "state" / "deploy-timeline")] == STEPS
