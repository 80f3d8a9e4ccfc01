"""The node bootstrap actually executed, twice, in a sandbox: a private mount namespace where
/etc/fstab, /data, /etc/gpu-cluster, /etc/systemd/system, /var/lib/gpu-cluster and /opt/gpu-cluster
are sandbox directories, and only commands that would change the machine are recording stand-ins
(tests/standins: mount, docker, systemctl, aws, curl for IMDS, apt-get, nvidia-ctk), linked into
the sandbox's bin directory (the PATH has no /usr/local). ssh-keygen, unzip, mountpoint, awk and
the scripts themselves are real."""

import json
import os

import pytest
from bootstrap_sandbox import (
    DLAMI_DOCKER_CONFIG,
    DROPIN,
    FSTAB_LINE,
    LOCK_OPTION,
    NODE_CONFIG,
    Sandbox,
    host_paths,
    node_config,
)

# One worker runs them all: the bind targets below are the host's own paths, created for the module
# and removed after it; a second worker removing them mid-test left a sandbox writing to the host.
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a mount namespace"),
    pytest.mark.xdist_group("bootstrap-host-paths"),
]


@pytest.fixture(scope="module", autouse=True)
def mountpoints():
    yield from host_paths()


@pytest.fixture
def sandbox(tmp_path) -> Sandbox:
    return Sandbox(tmp_path)


def test_first_run_mounts_efs_via_fstab_builds_and_starts_the_container_and_signals(sandbox):
    result = sandbox.run()
    assert result.returncode == 0, result.stdout + result.stderr
    fstab = (sandbox.root / "fstab").read_text().splitlines()
    assert fstab[:2] == ["# original fstab", "UUID=abc / ext4 defaults 0 1"]
    assert fstab[2:] == [FSTAB_LINE]
    calls = sandbox.calls()
    assert "systemctl enable --now docker" in calls
    assert "mount /data" in calls
    build = [c for c in calls if c.startswith("docker build")]
    assert (
        build
        and "BASE_IMAGE=nvcr.io/nvidia/pytorch:24.12-py3" in build[0]
        and "-t gpu-cluster-train:abc123" in build[0]
    )
    run = [c for c in calls if c.startswith("docker run")]
    assert len(run) == 1
    for flag in (
        "--gpus all",
        "--net=host",
        "--ipc=host",
        "--restart unless-stopped",
        "--ulimit memlock=-1",
        "--ulimit nofile=1048576:1048576",  # Docker 25+ leaves a container a soft 1,024 (moby/moby#45534)
        "--cap-add SYSLOG",  # the probe's dmesg: the default seccomp profile gates syslog(2) (moby ccd22ff)
        "--shm-size=16g",
        "-v /data:/data",
        "-e IDLE_MINUTES=45",
        "-e SPOT=false",
        "-e AWS_REGION=eu-west-1",
        "-e INSTANCE_ID=i-0123456789abcdef0",  # the watchdog's heartbeat needs it (a fresh read, session 30)
    ):
        assert flag in run[0]
    signals = [c for c in calls if "signal-resource" in c]
    assert (
        len(signals) == 1
        and "--status SUCCESS" in signals[0]
        and "--logical-resource-id GpuNodesNode0ABC" in signals[0]
    )
    assert any(c.startswith("aws ssm put-parameter") and "/gpu-cluster/testcluster/ssh-host-key" in c for c in calls)
    ssh_dir = sandbox.root / "efs" / ".cluster" / "ssh"
    assert {"id_ed25519", "ssh_host_ed25519_key", "authorized_keys", "known_hosts", "config"} <= {
        p.name for p in ssh_dir.iterdir()
    }
    assert oct(ssh_dir.stat().st_mode & 0o777) == "0o700"
    assert "Port 4444" in (ssh_dir / "config").read_text()
    assert "FakeUserKeyForTests" in (sandbox.root / "etc-gpu-cluster" / "authorized_keys").read_text()
    mark = (sandbox.root / "efs" / ".cluster" / "ready" / "node0").read_text().split()
    assert mark[1] == "i-0123456789abcdef0"  # the idle watchdog tells a bootstrapping node by it
    assert "apt-get" not in " ".join(calls)  # docker, toolkit and nfs client were present


def test_second_run_changes_nothing(sandbox):
    assert sandbox.run().returncode == 0
    before, first_calls = sandbox.snapshot(), len(sandbox.calls())
    result = sandbox.run()
    assert result.returncode == 0, result.stdout + result.stderr
    assert sandbox.snapshot() == before
    second = sandbox.calls()[first_calls:]
    changing = [
        c
        for c in second
        if c.startswith(("mount", "docker build", "docker run", "docker rm"))
        or "signal-resource" in c
        or "put-parameter" in c
    ]
    assert changing == []


def test_a_failing_step_signals_failure_naming_the_step_and_stops(sandbox):
    result = sandbox.run(FAIL_MOUNT="1", MOUNT_ATTEMPTS="3")
    assert result.returncode != 0
    calls = sandbox.calls()
    assert [c for c in calls if c.startswith("mount")] == ["mount /data"] * 3
    signals = [c for c in calls if "signal-resource" in c]
    assert len(signals) == 1 and "--status FAILURE" in signals[0]
    assert "--unique-id i-0123456789abcdef0-failed-mount-efs" in signals[0]
    assert not [c for c in calls if c.startswith(("docker build", "docker run"))]
    log = (sandbox.root / "state" / "bootstrap.log").read_text()
    assert "EFS fs-0123abcd did not mount at /data" in log and "FAILED" in log


def test_the_instance_store_is_mounted_into_the_container_when_the_node_has_one(sandbox):
    """`fab data --extra "--stage-to /opt/dlami/nvme/..."` writes inside the container: without this
    mount the data would land on the root EBS volume."""
    store = sandbox.root / "nvme"
    store.mkdir()
    result = sandbox.run(INSTANCE_STORE=str(store))
    assert result.returncode == 0, result.stdout + result.stderr
    run = [c for c in sandbox.calls() if c.startswith("docker run")]
    assert len(run) == 1 and f"-v {store}:{store}:rslave" in run[0]  # a mount made later reaches the container
    missing = sandbox.root / "no-nvme"  # a type without instance store: no mount, no failure
    (sandbox.root / "docker-running").unlink()
    assert sandbox.run(INSTANCE_STORE=str(missing)).returncode == 0
    rerun = [c for c in sandbox.calls() if c.startswith("docker run")]
    assert len(rerun) == 2 and str(missing) not in rerun[1] and f"-v {store}" not in rerun[1]


def test_docker_starts_only_after_data_and_the_instance_store_are_mounted_on_a_reboot(sandbox):
    """And after the DLAMI's dlami-nvme.service, which makes the instance store anew at every boot: at a
    `fab start`, docker (and the container's bind of /opt/dlami/nvme) would otherwise race it."""
    result = sandbox.run()
    assert result.returncode == 0, result.stdout + result.stderr
    dropin = "[Unit]\nRequires=gpu-cluster-data.service\nAfter=gpu-cluster-data.service dlami-nvme.service\n"
    assert (sandbox.root / DROPIN).read_text() == dropin  # the retrying mount (test_bootstrap_every_boot)
    calls = sandbox.calls()
    # The unit is reloaded after the fstab line exists (systemd generates data.mount from it).
    assert calls.index("systemctl daemon-reload") < calls.index("mount /data")
    first = len(calls)
    assert sandbox.run().returncode == 0
    assert "systemctl daemon-reload" not in sandbox.calls()[first:]


def test_a_bare_ami_gets_its_tools_from_apt_waiting_for_the_dpkg_lock(tmp_path):
    sandbox = Sandbox(tmp_path, bare=True)
    result = sandbox.run()
    assert result.returncode == 0, result.stdout + result.stderr
    apt = [c for c in sandbox.calls() if c.startswith("apt-get ")]
    installed = [c.split(" install ")[1] for c in apt if " install " in c]
    assert installed == ["docker.io", "nvidia-container-toolkit", "nfs-common"]
    assert apt and all(LOCK_OPTION in c for c in apt), apt
    assert [c for c in sandbox.calls() if "signal-resource" in c and "--status SUCCESS" in c]
    first = len(sandbox.calls())
    assert sandbox.run().returncode == 0
    assert not [c for c in sandbox.calls()[first:] if c.startswith("apt-get")]


@pytest.mark.parametrize(
    "env, bare, step",
    [
        ({"FAIL_DOCKER_BUILD": "1"}, False, "build-image"),  # a plain command in a step function
        ({"FAIL_DOCKER_PULL_TIMES": "9", "PULL_ATTEMPTS": "3", "PULL_RETRY_SECONDS": "0"}, False, "pull-image"),
        ({"FAIL_APT": "1", "APT_UPDATE_ATTEMPTS": "1"}, True, "docker"),  # in a helper the step calls
        ({"FAIL_S3": "1"}, False, "image-context"),
        ({"CORRUPT_CONTEXT": "1"}, False, "image-context"),  # was in an `a && b` list
        ({"FAIL_IMDS": "public-keys"}, False, "cluster-identity"),  # inside a command substitution
    ],
    ids=["docker-build", "docker-pull", "apt-get", "s3-cp", "unzip", "imds-substitution"],
)
def test_a_failing_command_inside_a_step_signals_failure_naming_the_step_once(tmp_path, env, bare, step):
    sandbox = Sandbox(tmp_path, bare=bare)
    result = sandbox.run(**env)
    assert result.returncode != 0
    calls = sandbox.calls()
    signals = [c for c in calls if "signal-resource" in c]
    assert len(signals) == 1 and "--status FAILURE" in signals[0], signals
    assert f"--unique-id i-0123456789abcdef0-failed-{step}" in signals[0]
    assert not [c for c in calls if c.startswith("docker run")]
    log = (sandbox.root / "state" / "bootstrap.log").read_text()
    assert f"[node0/{step}] FAILED" in log


def test_a_pull_that_fails_a_few_times_is_retried_not_a_failed_deploy(sandbox):
    """nvcr.io's manifest or TLS failing once in a ~10 GB pull: docker retries layers, not the pull."""
    result = sandbox.run(FAIL_DOCKER_PULL_TIMES="2", PULL_RETRY_SECONDS="0")
    assert result.returncode == 0, result.stdout + result.stderr
    calls = sandbox.calls()
    assert len([c for c in calls if c.startswith("docker pull")]) == 3
    assert [c for c in calls if "signal-resource" in c and "--status SUCCESS" in c]
    log = (sandbox.root / "state" / "bootstrap.log").read_text()
    assert "docker pull failed (attempt 2/5); again in 0s" in log


@pytest.mark.parametrize("cards, efa", [("0", "0"), ("4", "1")])
def test_only_an_efa_node_builds_its_image_with_the_efa_installer(tmp_path, cards, efa):
    """Issue 28: the image's EFA user space is a build option (Dockerfile ARG EFA, tests/test_image.py);
    the bootstrap asks for it only where the node has EFA interfaces (EFA_CARDS from the stack's node-config
    parameter, which the user-data stub reads)."""
    sandbox = Sandbox(tmp_path)
    (sandbox.root / "node-config").write_text(node_config({**NODE_CONFIG, "EFA_CARDS": cards}) + "\n")
    devices = _efa_devices(tmp_path, int(cards))
    assert sandbox.run(EFA_DEVICES=str(devices)).returncode == 0
    (build,) = [c for c in sandbox.calls() if c.startswith("docker build")]
    assert f"--build-arg EFA={efa} " in build
    (run,) = [c for c in sandbox.calls() if c.startswith("docker run")]
    assert run.count("--device ") == int(cards) and all(f"--device {d} " in run for d in devices.iterdir())


def _efa_devices(tmp_path, count: int):
    devices = tmp_path / "infiniband"
    devices.mkdir()
    for index in range(count):
        (devices / f"uverbs{index}").touch()
    return devices


def test_a_node_short_of_its_efa_devices_fails_its_deploy_naming_them(tmp_path):
    """One uverbs device per EFA interface; a host whose efa driver brought up fewer (3 of a p4d's 4)
    fails at start-container, named, instead of at the first fab train (NCCL_NET=OFI finds no network)."""
    sandbox = Sandbox(tmp_path)
    (sandbox.root / "node-config").write_text(node_config({**NODE_CONFIG, "EFA_CARDS": "4"}) + "\n")
    devices = _efa_devices(tmp_path, 3)
    assert sandbox.run(EFA_DEVICES=str(devices)).returncode != 0
    (signal,) = [c for c in sandbox.calls() if "signal-resource" in c]
    assert "--status FAILURE" in signal and signal.endswith("-failed-start-container")
    log = (sandbox.root / "state" / "bootstrap.log").read_text()
    assert f"EFA: 3 of 4 devices in {devices}" in log
    assert not [c for c in sandbox.calls() if c.startswith("docker run")]


def test_docker_uses_cgroupfs_so_a_daemon_reload_leaves_the_container_its_gpus(sandbox):
    """NVIDIA/nvidia-container-toolkit#48 (NVIDIA's notice, open; #1227 on Ubuntu 22.04): with Docker's
    systemd cgroup driver, "something as simple as a systemctl daemon-reload" leaves a `--gpus`
    container with "Failed to initialize NVML: Unknown Error" until it is created again. The bootstrap
    itself reloads after the container starts (the deadline's cancel), and so does any package later.
    The cgroupfs driver (NVIDIA's Docker workaround) is merged into the AMI's daemon.json, docker
    restarted once, before the container is created; a second run restarts nothing."""
    assert sandbox.run().returncode == 0
    config = json.loads((sandbox.root / "etc-docker" / "daemon.json").read_text())
    assert config == {**DLAMI_DOCKER_CONFIG, "exec-opts": ["native.cgroupdriver=cgroupfs"]}
    calls = sandbox.calls()
    (restart,) = [i for i, c in enumerate(calls) if c == "systemctl restart docker"]
    (run,) = [i for i, c in enumerate(calls) if c.startswith("docker run")]
    check = max(i for i, c in enumerate(calls) if c.endswith("nvidia-smi -L") and c.startswith("docker exec"))
    assert restart < run < check  # created under cgroupfs, then its GPUs counted
    before = len(calls)
    assert sandbox.run().returncode == 0
    assert "systemctl restart docker" not in sandbox.calls()[before:]


@pytest.mark.parametrize(
    "env, line",
    [
        ({"CONTAINER_LOST_GPUS": "1"}, "gpu-cluster-train sees 0 of the host's 1 GPUs"),
        ({"HOST_GPUS": "0"}, "the host sees no GPU (nvidia-smi -L)"),
    ],
)
def test_a_node_whose_container_sees_fewer_gpus_than_its_host_fails_ready_named(sandbox, env, line):
    """The container must list every GPU the host does: a node that lost them (or never got them) fails
    its deploy at `ready`, named, instead of the first fab train finding no CUDA device. It writes no
    ready mark and keeps its deadline (it stops itself even after a reboot, the remedy one would try)."""
    assert sandbox.run(**env).returncode != 0
    (signal,) = [c for c in sandbox.calls() if "signal-resource" in c]
    assert "--status FAILURE" in signal and signal.endswith("-failed-ready")
    assert line in (sandbox.root / "state" / "bootstrap.log").read_text()
    assert not (sandbox.root / "efs" / ".cluster" / "ready" / "node0").exists()
    assert (sandbox.root / "systemd" / "gpu-cluster-deadline.timer").exists()


def test_a_daemon_json_docker_cannot_read_fails_the_docker_step_and_is_left_as_it_was(sandbox):
    """The merge runs as an assignment, where -e and the ERR trap apply: a daemon.json that is not JSON
    fails the `docker` step, named, and is not replaced by an empty one (losing the nvidia runtime)."""
    config = sandbox.root / "etc-docker" / "daemon.json"
    config.write_text('{"runtimes": {"nvidia": ')
    assert sandbox.run().returncode != 0
    (signal,) = [c for c in sandbox.calls() if "signal-resource" in c]
    assert "--status FAILURE" in signal and signal.endswith("-failed-docker")
    assert config.read_text() == '{"runtimes": {"nvidia": '
    assert "systemctl restart docker" not in sandbox.calls()
