"""The node bootstrap actually executed, twice, in a sandbox: a private mount namespace where
/etc/fstab, /data, /etc/gpu-cluster, /etc/systemd/system, /var/lib/gpu-cluster and /opt/gpu-cluster
are sandbox directories, and only commands that would change the machine are recording stand-ins
(tests/standins: mount, docker, systemctl, aws, curl for IMDS, apt-get, nvidia-ctk), linked into
the sandbox's bin directory (the PATH has no /usr/local). ssh-keygen, unzip, mountpoint, awk and
the scripts themselves are real."""

import os
import shlex
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

from stacks.bootstrap import render_user_data

# One worker runs them all: the bind targets below are the host's own paths, created for the module
# and removed after it; a second worker removing them mid-test left a sandbox writing to the host.
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a mount namespace"),
    pytest.mark.xdist_group("bootstrap-host-paths"),
]

OVERLAID = ["/data", "/etc/gpu-cluster", "/etc/systemd/system", "/var/lib/gpu-cluster", "/opt/gpu-cluster"]
STANDINS = REPO / "tests" / "standins"
# What a bare AMI lacks, and the bootstrap installs (the apt-get stand-in links them back in).
INSTALLABLE = ("docker", "nvidia-ctk", "mount.nfs4")
DROPIN = "systemd/docker.service.d/gpu-cluster-data.conf"
LOCK_OPTION = "-o DPkg::Lock::Timeout=300"
FSTAB_LINE = (
    "fs-0123abcd.efs.eu-west-1.amazonaws.com:/ /data nfs4 nfsvers=4.1,rsize=1048576,"
    "wsize=1048576,hard,timeo=600,retrans=2,noresvport,_netdev 0 0"
)
ENV = {
    "CLUSTER_NAME": "testcluster",
    "NODE_RANK": "0",
    "NODES": "2",
    "FILE_SYSTEM_ID": "fs-0123abcd",
    "AWS_REGION": "eu-west-1",
    "STACK_NAME": "GpuCluster-test",
    "SIGNAL_RESOURCE": "GpuNodesNode0ABC",
    "BASE_IMAGE": "nvcr.io/nvidia/pytorch:24.12-py3",
    "IMAGE_CONTEXT_PARAMETER": "/gpu-cluster/testcluster/image-context",
    "HOST_KEY_PARAMETER": "/gpu-cluster/testcluster/ssh-host-key",
    "IDLE_MINUTES_PARAMETER": "/gpu-cluster/testcluster/idle-minutes",  # the aws stand-in answers 45
}


@pytest.fixture(scope="module", autouse=True)
def mountpoints():
    created = [p for p in OVERLAID if not os.path.exists(p)]
    for path in created:
        os.makedirs(path)
    yield
    for path in reversed(created):
        shutil.rmtree(path, ignore_errors=True)


class Sandbox:
    def __init__(self, root: Path, bare: bool = False):
        self.root = root
        for name in ("efs", "etc-gpu-cluster", "systemd", "state", "opt", "work", "bin"):
            (root / name).mkdir()
        (root / "image-context").write_text("s3://cdk-assets/abc.zip abc123\n")
        for standin in STANDINS.iterdir():
            if not (bare and standin.name in INSTALLABLE):
                (root / "bin" / standin.name).symlink_to(standin)
        (root / "fstab").write_text("# original fstab\nUUID=abc / ext4 defaults 0 1\n")
        with zipfile.ZipFile(root / "context.zip", "w") as archive:
            for part in ("docker", "autostop"):
                for path in (REPO / "assets" / part).iterdir():
                    archive.write(path, f"{part}/{path.name}")
        # The user-data exactly as the stack renders it, with plain values for the tokens.
        (root / "user-data.sh").write_text("#!/bin/bash\n" + render_user_data(ENV))

    def run(self, **env) -> subprocess.CompletedProcess:
        binds = {
            "/etc/fstab": self.root / "fstab",
            "/etc/gpu-cluster": self.root / "etc-gpu-cluster",
            "/etc/systemd/system": self.root / "systemd",
            "/var/lib/gpu-cluster": self.root / "state",
            "/opt/gpu-cluster": self.root / "opt",
            "/usr/local/sbin": self.root / "work",
        }
        if (self.root / "efs-mounted").exists():  # the machine keeps /data mounted between runs
            binds["/data"] = self.root / "efs"
        script = "; ".join(
            ["set -e"]
            + [f"/usr/bin/mount --bind {shlex.quote(str(src))} {target}" for target, src in binds.items()]
            + [f"exec bash {shlex.quote(str(self.root / 'user-data.sh'))}"]
        )
        environment = dict(
            os.environ,
            SANDBOX=str(self.root),
            PATH=f"{self.root / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin",
            MOUNT_RETRY_SECONDS="0",
            **env,
        )
        return subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--", "bash", "-c", script],
            capture_output=True,
            text=True,
            env=environment,
            timeout=120,
        )

    def calls(self) -> list[str]:
        path = self.root / "calls.log"
        return path.read_text().splitlines() if path.exists() else []

    def snapshot(self) -> dict:
        return {
            str(p.relative_to(self.root)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(self.root.rglob("*"))
            if p.is_file() and p.name != "calls.log" and "bootstrap.log" not in p.name and "docker-" not in p.name
        }


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
        "--shm-size=16g",
        "-v /data:/data",
        "-e IDLE_MINUTES=45",
        "-e SPOT=false",
        "-e AWS_REGION=eu-west-1",
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
    assert (sandbox.root / "efs" / ".cluster" / "ready" / "node0").exists()
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
    assert len(run) == 1 and f"-v {store}:{store}" in run[0]
    missing = sandbox.root / "no-nvme"  # a type without instance store: no mount, no failure
    (sandbox.root / "docker-running").unlink()
    assert sandbox.run(INSTANCE_STORE=str(missing)).returncode == 0
    rerun = [c for c in sandbox.calls() if c.startswith("docker run")]
    assert len(rerun) == 2 and str(missing) not in rerun[1] and f"-v {store}" not in rerun[1]


def test_docker_starts_only_after_data_is_mounted_on_a_reboot(sandbox):
    result = sandbox.run()
    assert result.returncode == 0, result.stdout + result.stderr
    assert (sandbox.root / DROPIN).read_text() == "[Unit]\nRequiresMountsFor=/data\n"
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
    assert "signal-resource" in sandbox.calls()[-1] and "--status SUCCESS" in sandbox.calls()[-1]
    first = len(sandbox.calls())
    assert sandbox.run().returncode == 0
    assert not [c for c in sandbox.calls()[first:] if c.startswith("apt-get")]


@pytest.mark.parametrize(
    "env, bare, step",
    [
        ({"FAIL_DOCKER_BUILD": "1"}, False, "build-image"),  # a plain command in a step function
        ({"FAIL_APT": "1", "APT_UPDATE_ATTEMPTS": "1"}, True, "docker"),  # in a helper the step calls
        ({"FAIL_S3": "1"}, False, "image-context"),
        ({"CORRUPT_CONTEXT": "1"}, False, "image-context"),  # was in an `a && b` list
        ({"FAIL_IMDS": "public-keys"}, False, "cluster-identity"),  # inside a command substitution
    ],
    ids=["docker-build", "apt-get", "s3-cp", "unzip", "imds-substitution"],
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
