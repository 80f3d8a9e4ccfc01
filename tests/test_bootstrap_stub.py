"""The user-data stub (stacks/bootstrap.py) executed in the bootstrap sandbox (tests/bootstrap_sandbox.py):
it fetches the node config and the bootstrap script, and a fetch that fails signals FAILURE at once
(else CloudFormation waits out the creation policy's 45 minutes); what it fetched is what runs."""

import os

import pytest
from bootstrap_sandbox import NODE_CONFIG, Sandbox, host_paths, scheduled_stop_runs_unless_kept

from stacks.bootstrap import node_config

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a mount namespace"),
    pytest.mark.xdist_group("bootstrap-host-paths"),
]
INSTANCE_ID = "i-0123456789abcdef0"


@pytest.fixture(scope="module", autouse=True)
def mountpoints():
    yield from host_paths()


@pytest.fixture
def sandbox(tmp_path) -> Sandbox:
    return Sandbox(tmp_path)


def _signals(sandbox: Sandbox) -> list[str]:
    return [c for c in sandbox.calls() if "signal-resource" in c]


def test_the_stub_fetches_the_config_and_the_script_and_the_script_uses_the_config(sandbox):
    """The base image comes from the node-config parameter, not from user data: `-c image=...` replaces
    no node, and a node launched after it builds on the new image."""
    (sandbox.root / "node-config").write_text(
        node_config({**NODE_CONFIG, "BASE_IMAGE": "nvcr.io/nvidia/pytorch:25.01-py3"})
    )
    result = sandbox.run()
    assert result.returncode == 0, result.stdout + result.stderr
    calls = sandbox.calls()
    fetches = [c for c in calls if c.startswith(("aws ssm get-parameter", "aws s3 cp"))]
    assert "/gpu-cluster/testcluster/node-config" in fetches[0]
    assert fetches[1].startswith(f"aws s3 cp --region eu-west-1 --only-show-errors {NODE_CONFIG['BOOTSTRAP_URL']} ")
    assert [c for c in calls if c.startswith("docker build")][0].count("BASE_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3")
    installed = (sandbox.root / "work" / "gpu-cluster-bootstrap").read_text()
    assert installed == (sandbox.root / "bootstrap-asset.sh").read_text()
    env = (sandbox.root / "etc-gpu-cluster" / "bootstrap.env").read_text().splitlines()
    assert "NODE_RANK=0" in env and "SPOT=false" in env and "EFA_CARDS=0" in env
    assert [s for s in _signals(sandbox) if "FAILURE" in s] == []


@pytest.mark.parametrize(
    ("failure", "step"),
    [({"FAIL_NODE_CONFIG": "1"}, "fetch-config"), ({"FAIL_S3_BOOTSTRAP": "1"}, "fetch-bootstrap")],
)
def test_a_fetch_that_fails_signals_failure_at_once_and_runs_no_bootstrap(sandbox, failure, step):
    result = sandbox.run(**failure)
    assert result.returncode != 0
    assert _signals(sandbox) == [
        "aws cloudformation signal-resource --region eu-west-1 --stack-name GpuCluster-test "
        f"--logical-resource-id GpuNodesNode0ABC --status FAILURE --unique-id {INSTANCE_ID}-failed-{step}"
    ]
    assert f"{step} failed" in result.stderr
    assert not [c for c in sandbox.calls() if c.startswith(("docker", "mount", "systemctl "))]
    assert not (sandbox.root / "work" / "gpu-cluster-bootstrap").exists()


def test_a_stub_that_fails_stops_its_own_node_after_a_grace_period_unless_kept(sandbox):
    """With `cdk deploy --no-rollback` (README's advice) a node whose user data failed has no watchdog and no
    alarm: nothing else would ever stop it. It stops itself in 45 min as a failed bootstrap does
    (StopInstances on itself); keep-running keeps it, and a node that bootstrapped before is left alone."""
    failed = sandbox.run(FAIL_S3_BOOTSTRAP="1")
    assert failed.returncode != 0 and "stops itself in 45 min" in failed.stderr
    scheduled_stop_runs_unless_kept(sandbox, INSTANCE_ID)
    assert (sandbox.root / "run" / "failed-stop").exists()  # the bootstrap's mark: its success cancels the stop
    (sandbox.root / "state" / "signalled").touch()
    before = len(sandbox.calls())
    assert sandbox.run(FAIL_S3_BOOTSTRAP="1").returncode != 0
    assert not [c for c in sandbox.calls()[before:] if c.startswith("systemd-run")]


def test_a_bootstrap_that_cannot_be_started_signals_failure_and_schedules_the_stop(sandbox):
    """bash ends at a failed `exec` without running its EXIT trap (a non-interactive shell, execfail off): a
    script whose interpreter line is wrong would have signalled nothing, and CloudFormation waited 45 min."""
    asset = sandbox.root / "bootstrap-asset.sh"
    asset.write_text("#!/no/such/interpreter\n" + asset.read_text())
    failed = sandbox.run()
    assert failed.returncode != 0
    assert [s.split("--unique-id ")[1] for s in _signals(sandbox)] == [f"{INSTANCE_ID}-failed-start-bootstrap"]
    assert [c for c in sandbox.calls() if c.startswith("systemd-run")]


def test_a_first_call_before_the_credentials_are_served_is_retried_not_a_failed_deploy(sandbox):
    """The stub's AWS calls are the boot's first: the instance profile's credentials (or the private subnet's
    route) can come seconds later (aws/aws-cli#1325). Two refused calls, then the third goes through."""
    result = sandbox.run(FAIL_NODE_CONFIG_TIMES="2")
    assert result.returncode == 0, result.stdout + result.stderr
    fetches = [c for c in sandbox.calls() if "/node-config" in c and c.startswith("aws ssm get-parameter")]
    assert len(fetches) == 3
    assert [s for s in _signals(sandbox) if "FAILURE" in s] == []


def test_a_config_line_that_is_not_a_plain_value_is_refused_not_run(sandbox):
    """The stub appends the config to the env file the bootstrap sources as root: shell syntax there would
    run. The stack writes plain values only; anything else is a failure signalled at once."""
    (sandbox.root / "node-config").write_text(node_config({**NODE_CONFIG, "SPOT": "$(touch /tmp/x)"}))
    result = sandbox.run()
    assert result.returncode != 0
    assert "not KEY=VALUE: SPOT=$(touch /tmp/x)" in result.stderr
    assert len(_signals(sandbox)) == 1 and "--status FAILURE" in _signals(sandbox)[0]
    assert "-failed-fetch-config" in _signals(sandbox)[0]


def test_the_stub_run_again_changes_nothing_and_a_new_script_replaces_the_old(sandbox):
    assert sandbox.run().returncode == 0
    script = sandbox.root / "work" / "gpu-cluster-bootstrap"
    env_file = sandbox.root / "etc-gpu-cluster" / "bootstrap.env"
    before = (script.stat().st_mtime_ns, env_file.stat().st_mtime_ns)
    assert sandbox.run().returncode == 0
    assert (script.stat().st_mtime_ns, env_file.stat().st_mtime_ns) == before
    assert not list((sandbox.root / "work").glob("*.new")) and not list(
        (sandbox.root / "etc-gpu-cluster").glob("*.new")
    )
    edited = (sandbox.root / "bootstrap-asset.sh").read_text().replace("# GPU cluster node bootstrap.", "# edited.", 1)
    (sandbox.root / "bootstrap-asset.sh").write_text(edited)
    assert sandbox.run().returncode == 0
    assert script.read_text() == edited
