"""Shared fixtures. Everything runs offline with the real tools (CDK CLI, sshd, mpirun, moto server)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterops.local.imds import serve_imds  # noqa: F401 (the tests import it from here)

REPO = Path(__file__).resolve().parent.parent
TRAIN_DIR = REPO / "assets" / "train"
# stacks, clusterops, fabfile, cluster_node and train come from the editable install (scripts/setup.sh).

OFFLINE_ENV = {
    "CDK_DISABLE_VERSION_CHECK": "1",
    "CDK_DISABLE_CLI_TELEMETRY": "true",
    "AWS_EC2_METADATA_DISABLED": "true",
    "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
    "JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION": "1",
    # aws-cdk-lib's built-in CloudFormation validation (a WASM engine: ~3.2 of a synth's ~4.7 CPU-seconds; its
    # findings warn, never fail). test_synth_cli's synths run it as a user's `cdk synth` does, and check it is
    # clean; the suite's other synths (moto deploys, the templates built in-process) leave it out.
    "CDK_VALIDATION": "false",
}
os.environ.update(OFFLINE_ENV)
# jsii (in-process CDK) and the CDK CLI run on the pinned Node in node_modules, not the machine's.
os.environ["PATH"] = f"{REPO / 'node_modules' / '.bin'}:{os.environ.get('PATH', '')}"


def trainer_tests() -> tuple[set[str], dict[str, str]]:
    """tests/trainer_tests.txt: the modules `make test-image-torch` runs on the image's torch, and the
    node-id prefixes it leaves out (with why): those run in `make test`'s first phase only."""
    listed, deselected = set(), {}
    for line in (REPO / "tests" / "trainer_tests.txt").read_text().splitlines():
        if line.startswith("- "):
            node, _, why = line[2:].partition("#")
            deselected[node.strip()] = why.strip()
        elif line and line[0] != "#":
            listed.add(line)
    return listed, deselected


def pytest_addoption(parser):
    parser.addoption(
        "--except-image-torch",
        action="store_true",
        help="leave out the tests that make test-image-torch runs (tests/trainer_tests.txt): make test's first phase",
    )


def pytest_collection_modifyitems(config, items):
    """Slow tests first: xdist hands tests out in this order, so a long one never starts last and ends
    the phase alone (a stable sort: the rest keep their order). --except-image-torch: the trainer's tests
    run once in `make test`, on the torch that trains (the image's, in its third phase); the checkout's
    torch runs the trainer end to end in the cluster phase."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if not config.getoption("except_image_torch"):
        return
    listed, not_on_image = trainer_tests()
    elsewhere = [
        item
        for item in items
        if item.nodeid.split("::")[0] in listed and not any(item.nodeid.startswith(n) for n in not_on_image)
    ]
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        dropped = set(elsewhere)
        items[:] = [item for item in items if item not in dropped]


def cdk_app(**context):
    """An app with cdk.json's context (its feature flags change what constructs synthesize: the
    EFS file-system policy, for one), as `cdk synth` builds it."""

    import aws_cdk

    return aws_cdk.App(context={**json.loads((REPO / "cdk.json").read_text())["context"], **context})


def tool_env(**extra: str) -> dict:
    """Environment for subprocesses: the venv and node_modules first on PATH."""
    env = {**os.environ, **OFFLINE_ENV, **extra}
    env["PATH"] = f"{REPO / '.venv' / 'bin'}:{REPO / 'node_modules' / '.bin'}:{env.get('PATH', '')}"
    return env


def run_fab(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The real `fab` CLI from the repository, with tool_env(**env), output captured."""
    return subprocess.run(["fab", *args], cwd=REPO, env=tool_env(**env), capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="session", autouse=True)
def checkout_stays_clean():
    """No test writes CDK context (AZ lookups, offerings) into the checkout's cdk.context.json."""
    context = REPO / "cdk.context.json"
    before = context.read_bytes() if context.exists() else None
    yield
    after = context.read_bytes() if context.exists() else None
    assert after == before, "a test wrote cdk.context.json into the checkout"


@pytest.fixture(scope="session")
def numbers_data(tmp_path_factory) -> Path:
    """A small numbers data set, prepared once per session by the real prepare.py."""
    from train import prepare

    out = tmp_path_factory.mktemp("numbers")
    prepare.main(["numbers", "--out", str(out), "--train", "6000", "--valid", "200", "--test", "100", "--vocab", "400"])
    return out


# ---------------------------------------------------------------- a moto server (AWS emulator)

ACCOUNT, REGION = "123456789012", "us-east-1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_moto() -> tuple[subprocess.Popen, int]:
    """moto_server on a free port, accepting connections. The port is free when chosen, not reserved: if
    another process takes it first, moto exits, and it starts again on another."""
    for _ in range(3):
        port = _free_port()
        # All addresses of this machine: the emulated cluster's nodes reach it through their bridge.
        process = subprocess.Popen(
            [str(REPO / ".venv" / "bin" / "moto_server"), "-H", "0.0.0.0", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while process.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return process, port
            except OSError:
                time.sleep(0.1)
        process.kill()
        process.wait()
    pytest.fail("moto_server did not start: three tries, each on a free port, each given 30 s")


@pytest.fixture(scope="session")
def moto_endpoint():
    process, port = _start_moto()
    # `localhost`, not 127.0.0.1: the CDK CLI's S3 client needs it for the template upload.
    yield f"http://localhost:{port}"
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="session")
def moto_env(moto_endpoint) -> dict:
    """The variables that point boto3 and the CDK CLI at the moto server (not set anywhere)."""
    return {
        "AWS_ENDPOINT_URL": moto_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "CDK_DEFAULT_ACCOUNT": ACCOUNT,
        "CDK_DEFAULT_REGION": REGION,
    }


@contextlib.contextmanager
def environment(values: dict):
    """os.environ with `values` for the duration, then exactly as before."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield values
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def aws_env(moto_env):
    """The moto server's variables in os.environ for this test only."""
    with environment(moto_env):
        yield moto_env


def idle_alarm(name: str, cluster: str) -> None:
    """A node's idle alarm in the moto server, tagged with its cluster, as the stack's IdleAlarmN creates it."""
    import boto3

    boto3.client("cloudwatch").put_metric_alarm(
        AlarmName=name,
        MetricName="Busy",
        Namespace="GpuCluster/Autostop",
        Statistic="Maximum",
        Period=60,
        EvaluationPeriods=1,
        Threshold=1,
        ComparisonOperator="LessThanThreshold",
        Tags=[{"Key": "gpu-cluster:name", "Value": cluster}],
    )


def moto_instances(count: int, cluster: str | None = None, instance_type: str = "g4dn.xlarge") -> list[str]:
    """Launch instances in the moto server (optionally tagged as a cluster's); returns their ids."""
    import boto3

    ec2 = boto3.client("ec2")
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    tags = [{"ResourceType": "instance", "Tags": [{"Key": "gpu-cluster:name", "Value": cluster}]}] if cluster else []
    launched = ec2.run_instances(
        ImageId=image, MinCount=count, MaxCount=count, InstanceType=instance_type, TagSpecifications=tags
    )["Instances"]
    return [i["InstanceId"] for i in launched]


def mark_ready(data: Path, ids: list[str]) -> None:
    """What each node's bootstrap writes once it is ready (node-bootstrap.sh mark_ready): DATA/.cluster/ready/nodeR
    naming its instance; the idle watchdog holds its stop while a tagged node no mark names is bootstrapping."""
    ready = data / ".cluster" / "ready"
    ready.mkdir(parents=True, exist_ok=True)
    for rank, instance in enumerate(ids):
        (ready / f"node{rank}").write_text(f"2026-11-27T00:00:00Z {instance}\n")


@pytest.fixture
def fake_imds():
    with serve_imds() as server:
        yield server


def one_node_inventory(tmp_path: Path, cluster: str, port: int, key: str) -> Path:
    """tmp_path/inventory.json: one local node at 127.0.0.1:`port`, known_hosts and the data directory in
    tmp_path (the tests that drive fab against one sshd, or none)."""
    from clusterops.inventory import Inventory, Node, SshSettings

    path = tmp_path / "inventory.json"
    Inventory(
        cluster=cluster,
        source="local",
        nodes=[Node(rank=0, name="node0", public_ip="127.0.0.1", private_ip="127.0.0.1")],
        gpus_per_node=1,
        ssh=SshSettings("root", port, str(tmp_path / key), str(tmp_path / "known_hosts")),
        data_dir=str(tmp_path / "data"),
        python=sys.executable,  # the node programs (cluster_node.programs.runs reads the run files) from the checkout
        code_dir=str(REPO / "assets" / "train"),
    ).save(path)
    return path
