"""What the bootstrap leaves for every later boot (a stop/start, `fab start`, a Spot restart: user data
runs only at the first), executed in the bootstrap sandbox (tests/bootstrap_sandbox.py): the /data
mount that heals, the NFS options, the idle alarm reset from the host, and a failed bootstrap that
stops its own node. A unit's ExecStart, and a command scheduled for later, run as the machine
would run them; `systemd-analyze verify` (the real one) reads the units."""

import os
import shlex
import shutil
import subprocess

import pytest
from bootstrap_sandbox import DROPIN, Sandbox, host_paths, scheduled_stop_runs_unless_kept, unit_value

from cluster_node.protocol.contract import BUSY_UNIT

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


DATA_UNIT = "systemd/gpu-cluster-data.service"
ALARM_UNIT = "systemd/gpu-cluster-idle-alarm.service"
INSTANCE_ID = "i-0123456789abcdef0"


def fstab_options(sandbox: Sandbox) -> list[str]:
    line = [x for x in (sandbox.root / "fstab").read_text().splitlines() if " /data " in x]
    assert len(line) == 1, line
    return line[0].split()[3].split(",")


def enabled(sandbox: Sandbox, unit: str) -> bool:
    """`systemctl enable UNIT` without --now: it starts at the next boot, not in this one."""
    return any(c.startswith("systemctl enable ") and unit in c.split() and "--now" not in c for c in sandbox.calls())


def reboot(sandbox: Sandbox) -> None:
    """A later boot: /data is not mounted yet, /run is empty (a tmpfs), earlier calls are forgotten."""
    (sandbox.root / "efs-mounted").unlink(missing_ok=True)
    (sandbox.root / "calls.log").unlink(missing_ok=True)
    for path in (sandbox.root / "run").iterdir():
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def no_wait(sandbox: Sandbox) -> None:
    """A `sleep` that records instead of waiting, for retry loops."""
    (sandbox.root / "bin" / "sleep").symlink_to(sandbox.root / "bin" / "systemctl")


def verify_units(sandbox: Sandbox, *units: str) -> None:
    if shutil.which("systemd-analyze") is None:
        return
    paths = " ".join(f"/etc/systemd/system/{u.split('/')[-1]}" for u in units)
    result = sandbox.command(f"systemd-analyze verify --man=no {paths}")
    # A missing executable fails it; a key or value it cannot parse is only a warning: none allowed.
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


def test_a_failed_data_mount_at_boot_is_retried_until_it_heals(sandbox):
    """systemd.mount(5) has no Restart=: with docker.service's RequiresMountsFor=/data, a data.mount
    that fails once at boot (DNS, the mount target) left dockerd, so the container, down until a
    human came. The fix: a oneshot that retries `mount /data` until it holds (a job that is still
    running keeps dockerd's start job waiting: systemd.unit(5) After=), and docker requires it.
    AWS EFS User Guide, "Mounting EFS file systems automatically": `_netdev` (network file system)
    and `nofail` (the instance boots even if the mount fails)."""
    assert sandbox.run().returncode == 0
    assert {"_netdev", "nofail"} <= set(fstab_options(sandbox))
    dropin = (sandbox.root / DROPIN).read_text()
    assert "RequiresMountsFor" not in dropin
    assert unit_value(sandbox.root / DROPIN, "Requires") == ["gpu-cluster-data.service"]
    assert unit_value(sandbox.root / DROPIN, "After") == ["gpu-cluster-data.service dlami-nvme.service"]
    unit = sandbox.root / DATA_UNIT
    assert unit_value(unit, "WantedBy") == ["multi-user.target"] and unit_value(unit, "Type") == ["oneshot"]
    assert "network-online.target" in unit_value(unit, "After")[0]
    assert enabled(sandbox, "gpu-cluster-data.service")
    verify_units(sandbox, DATA_UNIT)

    reboot(sandbox)
    no_wait(sandbox)
    (exec_start,) = unit_value(unit, "ExecStart")
    healed = sandbox.command(exec_start, FAIL_MOUNT_TIMES="3")
    assert healed.returncode == 0, healed.stdout + healed.stderr
    calls = sandbox.calls()
    assert [c for c in calls if c.startswith("mount")] == ["mount /data"] * 4
    assert len([c for c in calls if c.startswith("sleep")]) == 3
    assert (sandbox.root / "efs-mounted").exists()


def test_the_data_mount_revalidates_negative_lookups_so_a_stop_file_shows_at_once(sandbox):
    """nfs(5) lookupcache: with the default (all) a name looked up and not found stays "not found"
    until the directory's cached attributes expire (acdirmin 30 s, acdirmax 60 s), so rank 0 could
    miss a STOP that the Spot watcher on another node wrote for up to a minute of the two-minute
    notice; `positive` always revalidates negative entries. The AWS-recommended options stay (EFS User
    Guide, "Recommended NFS mount settings")."""
    assert sandbox.run().returncode == 0
    options = fstab_options(sandbox)
    assert "lookupcache=positive" in options
    for recommended in (
        "nfsvers=4.1",
        "rsize=1048576",
        "wsize=1048576",
        "hard",
        "timeo=600",
        "retrans=2",
        "noresvport",
    ):
        assert recommended in options
    assert not any(o.startswith(("lookupcache=all", "lookupcache=none", "actimeo", "noac")) for o in options)


def test_every_boot_resets_the_idle_alarm_from_the_host_after_a_busy_beat(sandbox):
    """CloudWatch acts on a state change only ("Alarm states"; SetAlarmState): a node stopped for
    longer than the alarm's window starts again with its alarm already in ALARM, and it never stops
    it again. A host unit (not the container, which may never come back) sets it to OK at every
    boot. First it publishes one busy beat and waits until CloudWatch serves it: SetAlarmState says
    a metric alarm "returns to its actual state quickly, often within seconds", and over a window of
    missing (breaching) data that is ALARM again, which would stop the node it just let start."""
    assert sandbox.run().returncode == 0
    unit = sandbox.root / ALARM_UNIT
    assert unit_value(unit, "WantedBy") == ["multi-user.target"]
    assert "network-online.target" in unit_value(unit, "After")[0]
    assert enabled(sandbox, "gpu-cluster-idle-alarm.service")
    assert not [c for c in sandbox.calls() if "set-alarm-state" in c]  # the first boot: no alarm yet
    verify_units(sandbox, ALARM_UNIT)

    reboot(sandbox)
    no_wait(sandbox)
    (exec_start,) = unit_value(unit, "ExecStart")
    result = sandbox.command(exec_start, METRIC_MAXIMUM="None")  # not served yet: waits
    assert result.returncode == 0, result.stdout + result.stderr
    calls = sandbox.calls()
    beat = [i for i, c in enumerate(calls) if c.startswith("aws cloudwatch put-metric-data")]
    reset = [i for i, c in enumerate(calls) if c.startswith("aws cloudwatch set-alarm-state")]
    assert len(beat) == 1 and len(reset) == 1 and beat[0] < reset[0]
    assert all(
        part in calls[beat[0]]
        for part in ("--namespace GpuCluster/Autostop", "--metric-name Busy", f"InstanceId={INSTANCE_ID}", "--value 1")
    )
    assert f"--unit {BUSY_UNIT} " in calls[beat[0]]  # the watchdog's unit (tests/test_idle_alarm_reset.py)
    assert "--alarm-name testcluster-node0-idle" in calls[reset[0]] and "--state-value OK" in calls[reset[0]]
    polls = [c for c in calls if "get-metric-statistics" in c]
    assert len(polls) == 30  # 5 min, then anyway
    assert all(f"Value={INSTANCE_ID}" in c and f"--unit {BUSY_UNIT} " in c for c in polls)
    assert "not served after 5 min" in result.stdout + result.stderr

    reboot(sandbox)  # served at once: no wait; no alarm (idle_minutes=0): a log line, no failure
    missing = sandbox.command(exec_start, NO_ALARM="testcluster-node0-idle")
    assert missing.returncode == 0, missing.stdout + missing.stderr
    assert len([c for c in sandbox.calls() if "get-metric-statistics" in c]) == 1
    assert "no idle alarm" in missing.stdout + missing.stderr


def test_a_failed_bootstrap_stops_its_own_node_after_a_grace_period_unless_kept(sandbox):
    """`cdk deploy --no-rollback` keeps a node whose bootstrap failed: no watchdog, no alarm (it is
    created after the success signal). It stops itself after 45 min (time to log in and read the
    log) with EC2 StopInstances on itself: a stop, whatever InstanceInitiatedShutdownBehavior says,
    and a stop is what a persistent Spot request allows. `touch /var/lib/gpu-cluster/keep-running`
    keeps it; a later successful bootstrap cancels the stop."""
    failed = sandbox.run(FAIL_DOCKER_BUILD="1")
    assert failed.returncode != 0
    log = (sandbox.root / "state" / "bootstrap.log").read_text()
    assert "stops itself in 45 min" in log and "keep-running" in log
    kept = scheduled_stop_runs_unless_kept(sandbox, INSTANCE_ID)
    assert "keep-running" in kept.stdout + kept.stderr

    before = len(sandbox.calls())
    assert sandbox.run().returncode == 0  # fixed by hand, run again: the stop is cancelled
    assert "systemctl stop gpu-cluster-failed-stop.timer" in sandbox.calls()[before:]


def test_a_failed_rerun_on_a_node_that_bootstrapped_schedules_no_stop(sandbox):
    """Found by a read of the real path: a node that signalled success has its watchdog and alarm;
    a bootstrap run again by hand that fails (a transient error) must not stop it 45 min later,
    perhaps in the middle of a run."""
    (sandbox.root / "state" / "signalled").touch()  # it signalled SUCCESS once (mark_ready's marker)
    assert sandbox.run(FAIL_DOCKER_BUILD="1").returncode != 0  # a step run again fails
    assert not [c for c in sandbox.calls() if c.startswith("systemd-run")]
    assert "its watchdog still applies" in (sandbox.root / "state" / "bootstrap.log").read_text()


def test_the_scheduled_command_survives_shell_quoting(sandbox):
    """The stand-in stores what systemd-run would run; it must be one runnable command line."""
    assert sandbox.run(FAIL_S3="1").returncode != 0
    argv = shlex.split((sandbox.root / "scheduled").read_text())
    assert argv[0] == "/usr/local/sbin/gpu-cluster-bootstrap" and argv[-1] == "stop-failed"
    assert (
        subprocess.run(["bash", "-n", argv[0].replace("/usr/local/sbin", str(sandbox.root / "work"))]).returncode == 0
    )


def test_the_alarm_reset_is_retried_until_set_alarm_state_succeeds(sandbox):
    """Issue 28: the boot unit had one try; one transient error (a throttle, no route yet) left the
    node with its alarm in ALARM, so no stop ever again. systemd.service(5): Restart=on-failure is
    allowed for Type=oneshot since systemd 244 (systemd/systemd#7474; the Ubuntu 22.04 DLAMI has 249).
    The unit's command is run as systemd would: again after each failure, until it exits 0."""
    assert sandbox.run().returncode == 0
    unit = sandbox.root / ALARM_UNIT
    assert unit_value(unit, "Restart") == ["on-failure"] and unit_value(unit, "Type") == ["oneshot"]
    assert unit_value(unit, "RestartSec") == ["30"]  # 5 starts in 10 s (the default limit) never happen
    verify_units(sandbox, ALARM_UNIT)

    reboot(sandbox)
    no_wait(sandbox)
    (exec_start,) = unit_value(unit, "ExecStart")
    codes = []
    while not codes or codes[-1] != 0:
        assert len(codes) < 10, codes
        codes.append(sandbox.command(exec_start, FAIL_SET_ALARM_TIMES="3").returncode)
    assert all(c != 0 for c in codes[:3]) and codes[3:] == [0]
    resets = [c for c in sandbox.calls() if c.startswith("aws cloudwatch set-alarm-state")]
    assert len(resets) == 4 and (sandbox.root / "alarm-failures").read_text().strip() == "3"
    # One busy beat a boot: a reset failing for good must not keep the heartbeat busy (the alarm's net).
    assert len([c for c in sandbox.calls() if c.startswith("aws cloudwatch put-metric-data")]) == 1


def test_the_first_deploy_signals_success_only_once_cloudwatch_serves_a_busy_beat(sandbox):
    """Issue 28: CloudFormation creates the idle alarm right after the node's SUCCESS signal (its Ref
    to the instance); its window is all missing data, treated as breaching: ALARM, and a stop, unless
    a busy beat is in it. The bootstrap publishes one and waits until GetMetricStatistics serves it,
    as the boot unit does."""
    no_wait(sandbox)
    result = sandbox.run(METRIC_MAXIMUM="None")  # never served: 5 min of polls, then signals anyway
    assert result.returncode == 0, result.stdout + result.stderr
    calls = sandbox.calls()
    beat = [i for i, c in enumerate(calls) if c.startswith("aws cloudwatch put-metric-data")]
    polls = [i for i, c in enumerate(calls) if "get-metric-statistics" in c]
    (signal,) = [i for i, c in enumerate(calls) if "signal-resource" in c]
    assert len(beat) == 1 and beat[0] < polls[0] and polls[-1] < signal and len(polls) == 30
    assert f"InstanceId={INSTANCE_ID}" in calls[beat[0]] and "--value 1" in calls[beat[0]]
    assert "--status SUCCESS" in calls[signal]
    assert "not served after 5 min" in (sandbox.root / "state" / "bootstrap.log").read_text()


DEADLINE = ("systemd/gpu-cluster-deadline.timer", "systemd/gpu-cluster-deadline.service")


def test_a_hung_bootstrap_stops_its_node_later_even_after_a_reboot(sandbox):
    """Issue 28: a bootstrap that hangs (a stalled docker pull) runs no ERR trap, so it scheduled no
    stop; under `cdk deploy --no-rollback` the node billed on. A timer armed before the first step
    stops it 90 min later; it is enabled (timers.target), so each later boot arms it again (a
    transient systemd-run timer is gone after a reboot, and user data runs once); ready cancels it."""
    hung = sandbox.run(HANG_DOCKER_PULL="1")
    assert hung.returncode != 0
    calls = sandbox.calls()
    assert not [c for c in calls if "signal-resource" in c or c.startswith("systemd-run")]  # no trap ran
    pull = calls.index(next(c for c in calls if c.startswith("docker pull")))
    assert calls.index("systemctl enable --now gpu-cluster-deadline.timer") < pull  # enabled and started
    timer, service = (sandbox.root / p for p in DEADLINE)
    assert unit_value(timer, "OnActiveSec") == ["90min"] and unit_value(timer, "WantedBy") == ["timers.target"]
    verify_units(sandbox, *DEADLINE)

    reboot(sandbox)  # enabled: the boot starts the timer again; when it fires, its service runs
    (exec_start,) = unit_value(service, "ExecStart")
    assert sandbox.command(exec_start).returncode == 0
    assert [c for c in sandbox.calls() if "stop-instances" in c] == [
        f"aws ec2 stop-instances --region eu-west-1 --instance-ids {INSTANCE_ID}"
    ]

    before = len(sandbox.calls())
    assert sandbox.run().returncode == 0  # the pull works this time: ready, the deadline is gone
    assert "systemctl disable --now gpu-cluster-deadline.timer" in sandbox.calls()[before:]
    assert not any((sandbox.root / p).exists() for p in DEADLINE)
