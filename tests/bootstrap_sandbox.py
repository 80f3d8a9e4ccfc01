"""The bootstrap sandbox (see tests/test_bootstrap.py): a private mount namespace where /etc/fstab,
/data, /etc/gpu-cluster, /etc/systemd/system, /var/lib/gpu-cluster, /opt/gpu-cluster and
/usr/local/sbin are sandbox directories, and machine-changing commands are recording stand-ins."""

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

from conftest import REPO

from stacks.bootstrap import node_config
from stacks.userdata import render_user_data

OVERLAID = [
    "/data",
    "/etc/gpu-cluster",
    "/etc/systemd/system",
    "/var/lib/gpu-cluster",
    "/opt/gpu-cluster",
    "/run/gpu-cluster",
    "/etc/docker",
]
STANDINS = REPO / "tests" / "standins"
# What a bare AMI lacks, and the bootstrap installs (the apt-get stand-in links them back in).
INSTALLABLE = ("docker", "nvidia-ctk", "mount.nfs4")
DROPIN = "systemd/docker.service.d/gpu-cluster-data.conf"
LOCK_OPTION = "-o DPkg::Lock::Timeout=300"
FSTAB_LINE = (
    "fs-0123abcd.efs.eu-west-1.amazonaws.com:/ /data nfs4 nfsvers=4.1,rsize=1048576,"
    "wsize=1048576,hard,timeo=600,retrans=2,noresvport,_netdev,nofail,lookupcache=positive 0 0"
)
ENV = {
    "CLUSTER_NAME": "testcluster",
    "NODE_RANK": "0",
    "FILE_SYSTEM_ID": "fs-0123abcd",
    "AWS_REGION": "eu-west-1",
    "STACK_NAME": "GpuCluster-test",
    "SIGNAL_RESOURCE": "GpuNodesNode0ABC",
    "NODE_CONFIG_PARAMETER": "/gpu-cluster/testcluster/node-config",  # the aws stand-in answers NODE_CONFIG
    "IMAGE_CONTEXT_PARAMETER": "/gpu-cluster/testcluster/image-context",
    "HOST_KEY_PARAMETER": "/gpu-cluster/testcluster/ssh-host-key",
    "IDLE_MINUTES_PARAMETER": "/gpu-cluster/testcluster/idle-minutes",  # the aws stand-in answers 45
    "IDLE_ALARM": "testcluster-node0-idle",
    "HEARTBEAT_NAMESPACE": "GpuCluster/Autostop",
    "INSTANCE_TYPE": "g5.xlarge",
}
# The node-config parameter's value (stacks/bootstrap.py node_config): the stub fetches the script from it.
BOOTSTRAP_URL = "s3://cdk-assets/0123abcd.sh"
NODE_CONFIG = {
    "BOOTSTRAP_URL": BOOTSTRAP_URL,
    "BASE_IMAGE": "nvcr.io/nvidia/pytorch:24.12-py3",
    "EFA_CARDS": "0",
    "SPOT": "false",
}
DLAMI_DOCKER_CONFIG = {"runtimes": {"nvidia": {"args": [], "path": "nvidia-container-runtime"}}}
BOOTSTRAP_SCRIPT = REPO / "assets" / "bootstrap" / "node-bootstrap.sh"


def host_paths():
    """For a module fixture: the bind targets, created on the host where missing, removed after by the
    last module using them (xdist runs several sandbox modules at once: a shared flock counts them, and
    a list beside it remembers which directories the tests created)."""
    import fcntl

    lock = os.path.join(tempfile.gettempdir(), "gpu-cluster-sandbox.lock")
    made = Path(lock + ".created")
    with open(lock, "w") as users:
        fcntl.flock(users, fcntl.LOCK_SH)
        for path in OVERLAID:
            if not os.path.exists(path):
                os.makedirs(path, exist_ok=True)
                with open(made, "a") as record:
                    record.write(path + "\n")
        yield
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no other module is using them
        except OSError:
            return
        created = made.read_text().split() if made.exists() else []
        for path in reversed(created):
            shutil.rmtree(path, ignore_errors=True)
        made.unlink(missing_ok=True)


class Sandbox:
    def __init__(self, root: Path, bare: bool = False):
        self.root = root
        for name in ("efs", "etc-gpu-cluster", "etc-docker", "systemd", "state", "opt", "work", "bin", "run"):
            (root / name).mkdir()
        (root / "image-context").write_text("s3://cdk-assets/abc.zip abc123\n")
        (root / "node-config").write_text(node_config(NODE_CONFIG) + "\n")
        shutil.copy(BOOTSTRAP_SCRIPT, root / "bootstrap-asset.sh")  # what `aws s3 cp BOOTSTRAP_URL` fetches
        for standin in STANDINS.iterdir():
            if not (bare and standin.name in INSTALLABLE):
                (root / "bin" / standin.name).symlink_to(standin)
        if not bare:  # the Deep Learning AMI's, as `nvidia-ctk runtime configure` writes it
            (root / "etc-docker" / "daemon.json").write_text(json.dumps(DLAMI_DOCKER_CONFIG, indent=4) + "\n")
        (root / "fstab").write_text("# original fstab\nUUID=abc / ext4 defaults 0 1\n")
        with zipfile.ZipFile(root / "context.zip", "w") as archive:
            for part in ("docker", "cluster_node"):
                for path in sorted((REPO / "assets" / part).rglob("*")):
                    if path.is_file() and "__pycache__" not in path.parts:
                        archive.write(path, f"{part}/{path.relative_to(REPO / 'assets' / part).as_posix()}")
        # The user data exactly as the stack renders it (the stub), with plain values for the tokens.
        (root / "user-data.sh").write_text("#!/bin/bash\n" + render_user_data(ENV))

    def run(self, **env) -> subprocess.CompletedProcess:
        """The user data, as cloud-init runs it at the first boot."""
        return self.command(f"bash {shlex.quote(str(self.root / 'user-data.sh'))}", **env)

    def command(self, command: str, **env) -> subprocess.CompletedProcess:
        """Any shell command (a unit's ExecStart, a scheduled one) on the sandboxed machine."""
        binds = {
            "/etc/fstab": self.root / "fstab",
            "/etc/gpu-cluster": self.root / "etc-gpu-cluster",
            "/etc/systemd/system": self.root / "systemd",
            "/var/lib/gpu-cluster": self.root / "state",
            "/opt/gpu-cluster": self.root / "opt",
            "/run/gpu-cluster": self.root / "run",
            "/etc/docker": self.root / "etc-docker",
            "/usr/local/sbin": self.root / "work",
        }
        if (self.root / "efs-mounted").exists():  # the machine keeps /data mounted between runs
            binds["/data"] = self.root / "efs"
        script = "; ".join(
            ["set -e"]
            + [f"/usr/bin/mount --bind {shlex.quote(str(src))} {target}" for target, src in binds.items()]
            + [f"exec {command}"]
        )
        environment = dict(
            os.environ,
            SANDBOX=str(self.root),
            PATH=f"{self.root / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin",
            MOUNT_RETRY_SECONDS="0",
            AWS_RETRY_SECONDS="0",
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
        """Every file but the logs each run writes (calls, bootstrap.log, the deploy timelines)."""
        logs = ("calls.log", "bootstrap.log", "deploy-timeline")
        return {
            str(p.relative_to(self.root)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(self.root.rglob("*"))
            if p.is_file() and p.name not in logs and "docker-" not in p.name and p.parent.name != "deploy"
        }


def unit_value(unit: Path, key: str) -> list[str]:
    """Every value of `key=` in a systemd unit file."""
    return [line.split("=", 1)[1] for line in unit.read_text().splitlines() if line.startswith(f"{key}=")]


def scheduled_stop_runs_unless_kept(sandbox: Sandbox, instance_id: str) -> subprocess.CompletedProcess:
    """The node's own stop a failure scheduled (systemd-run, 45 min): run as the timer would, it stops the
    instance (StopInstances on itself); with keep-running it stops nothing. Returns the kept run."""
    (schedule,) = [c for c in sandbox.calls() if c.startswith("systemd-run")]
    assert "--on-active=45min" in schedule and "--unit=gpu-cluster-failed-stop" in schedule
    scheduled = (sandbox.root / "scheduled").read_text()
    before = len(sandbox.calls())
    assert sandbox.command(scheduled).returncode == 0
    stops = [c for c in sandbox.calls()[before:] if "stop-instances" in c]
    assert stops == [f"aws ec2 stop-instances --region eu-west-1 --instance-ids {instance_id}"]
    (sandbox.root / "state" / "keep-running").touch()
    before = len(sandbox.calls())
    kept = sandbox.command(scheduled)
    assert kept.returncode == 0 and not [c for c in sandbox.calls()[before:] if "stop-instances" in c]
    return kept
