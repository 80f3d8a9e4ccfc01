"""fab train --max-restarts on the emulated cluster (3 nodes): a hung rank, restarts used up, a lost
node by `fab drill kill-node` (the drill's report, the resume from the survivors' snapshots, that run's goodput
account and its `--follow` output: one run for all four). The real launcher, health
probe over SSH, mpirun, gloo and the trainer; the tests look at the shared /data from the host side and at
the namespaces' processes. The hang's window and the lost node's run (a 5 s window) are `timed`: make test
runs them alone. Restarts used up times nothing but its end (within 60 s of the second kill), so it runs
beside the other tests, with a hang window that a loaded machine's slow steps cannot fill."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cluster_harness import Cluster, start_cluster, stop_cluster
from conftest import REPO

from cluster_node.protocol import phases
from cluster_node.supervisor import goodput

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster needs root"),
]
# The baselines' and the lost node's run: ~0.15 s a step here; the first snapshot both survivors hold lands near
# step 20 and the drill's kill ~10 steps later, so 40 steps left a run ~2 s from its end when struck.
STEPS = 60
# Global batch 3 x 8 = 24; one eval (at the end) on few samples; checkpoints every 10 steps.
TINY = "--eval-every 1000 --eval-samples 16 --checkpoint-every 10 --log-every 10 --dist-timeout-s 30"
RESTARTING = ("--batch-per-gpu", "8", "--max-restarts", "1", "--hang-seconds", "5")
# Beside the other tests (untimed): a hang window that a loaded machine's slow steps after a restart do not fill.
RESTARTING_UNTIMED = ("--batch-per-gpu", "8", "--max-restarts", "1", "--hang-seconds", "20")


def _final_loss(cluster: Cluster, run: str) -> float:
    log = (cluster.run_dir(run) / "train.log").read_text()
    losses = re.findall(rf"step {STEPS}/{STEPS} \(100%\) \| loss ([0-9.]+)", log)
    return float(losses[-1])


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    cluster = start_cluster("tr", 3, "10.213.130.0/24", tmp_path_factory.mktemp("tr"))
    yield cluster
    stop_cluster(cluster)


@pytest.fixture(scope="module")
def baselines(trio) -> dict[str, float]:
    """The final loss of two uninterrupted runs (two seeds): their gap is the noise a restarted run is held to."""
    losses = {}
    for seed in ("1234", "99"):
        extra = f"{TINY} --seed {seed}"
        trio.fab(
            "train", "--run", f"base{seed}", "--steps", str(STEPS), "--batch-per-gpu", "8", "--follow", "--extra", extra
        )
        losses[seed] = _final_loss(trio, f"base{seed}")
    return losses


def _restarts(cluster: Cluster, run: str) -> list[dict]:
    path = cluster.run_dir(run) / "restarts.json"
    return json.loads(path.read_text()) if path.exists() else []


def _wait_for_restart(cluster: Cluster, run: str, timeout: float = 60) -> float:
    started = time.monotonic()
    while not _restarts(cluster, run):
        assert time.monotonic() - started < timeout, cluster.run_status(run)
        time.sleep(0.1)
    return time.monotonic() - started


def _beat(cluster: Cluster, run: str, rank: int = 0) -> tuple[int, int]:
    """The rank's (last finished step, pid) in the current attempt (its heartbeat); (-1, 0) before."""
    try:
        step, pid = (cluster.run_dir(run) / "ranks" / f"rank{rank}").read_text().split()[:2]
        return int(step), int(pid)
    except (OSError, ValueError):
        return -1, 0


def _wait_for_beat(cluster: Cluster, run: str, step: int, not_pid: int = 0, timeout: float = 60) -> float:
    """Seconds until rank 0 (a process other than `not_pid`) has finished a step past `step`."""
    started = time.monotonic()
    while _beat(cluster, run)[0] <= step or _beat(cluster, run)[1] == not_pid:
        assert time.monotonic() - started < timeout, f"{run} not past step {step}: {cluster.run_status(run)}"
        time.sleep(0.1)
    return time.monotonic() - started


def _wait_for_resume(cluster: Cluster, run: str, old_pid: int) -> float:
    """Seconds until a new rank 0 finishes a step past the restart's checkpoint."""
    return _wait_for_beat(cluster, run, _restarts(cluster, run)[0]["resume_step"], not_pid=old_pid)


def _wait_for_log(cluster: Cluster, run: str, text: str, timeout: float = 60) -> float:
    started = time.monotonic()
    while text not in (cluster.run_dir(run) / "train.log").read_text():
        assert time.monotonic() - started < timeout, f"no {text!r} in {run}'s log: {cluster.run_status(run)}"
        time.sleep(0.1)
    return time.monotonic() - started


@pytest.mark.timed
def test_a_stopped_rank_is_a_hang_within_the_window_with_stacks_and_the_rank_named(trio):
    trio.fab("train", "--run", "hang", "--steps", "30", *RESTARTING, "--extra", TINY)
    trio.wait_for_step("hang", 20)
    step_time = trio.progress("hang")["avg_step_time_s"]
    [victim] = trio.processes(1, r"[t]rain\.train --recipe")
    old_pid = _beat(trio, "hang")[1]
    os.kill(victim, signal.SIGSTOP)
    detected = _wait_for_log(trio, "hang", "watchdog: hang")
    decided = detected + _wait_for_restart(trio, "hang")
    resumed = _wait_for_resume(trio, "hang", old_pid)
    status, finished = trio.wait_for_end("hang", timeout=60)
    [record] = _restarts(trio, "hang")
    window = int(re.search(r"window (\d+) s", record["reason"]).group(1))
    print(
        f"hang ({step_time * 1000:.0f} ms/step, window {window} s): detected {detected:.1f} s after SIGSTOP, "
        f"restart decided at {decided:.1f} s, first step {resumed:.1f} s after that, finished {finished:.1f} s later"
    )
    assert status["state"] == "finished", status
    assert record["kind"] == "hang" and f"rank 1 (pid {victim} on" in record["reason"]
    assert "(stopped)" in record["reason"] and "hang-stacks-1" in record["reason"]
    # The window (5 s floor: 20 steps take less), a 1 s poll, 1 s heartbeat time stamps, then the stacks
    # (collected before the line is written: an ssh and a Python start per node in parallel, and a 2 s pause
    # for faulthandler): 9.4-10.7 s measured, so 11 s left no margin; a 5 s poll would still fail this.
    assert window == 5 and detected < window + 8
    assert len(record["nodes_after"]) == 3 and not record["dropped"]
    dumps = trio.run_dir("hang") / "hang-stacks-1"
    assert re.search(r'File ".*trainer\.py", line \d+ in ', (dumps / "rank0.txt").read_text())
    # (rank 1 dumps too, but only once Open MPI's SIGCONT before its SIGTERM wakes it up.)


def test_restarts_used_up_end_the_run_failed_with_the_history_and_a_loadable_checkpoint(trio):
    trio.fab("train", "--run", "used", "--steps", "5000", *RESTARTING_UNTIMED, "--extra", TINY)
    old_pid = 0
    for _ in range(2):
        done = _restarts(trio, "used")
        # (180 s, not 60: beside the other tests, a start and 12 steps take ~3x as long)
        _wait_for_beat(trio, "used", (done[-1]["resume_step"] + 12) if done else 12, not_pid=old_pid, timeout=180)
        [victim] = trio.processes(1, r"[t]rain\.train --recipe")
        old_pid = _beat(trio, "used")[1]
        os.kill(victim, signal.SIGKILL)
        if not _restarts(trio, "used"):
            _wait_for_restart(trio, "used", timeout=180)
    status, seconds = trio.wait_for_end("used", timeout=60)
    print(f"restarts used up: run failed {seconds:.1f} s after the second kill: {status['reason']}")
    assert status["state"] == "failed" and "restarts exhausted (1/1)" in status["reason"]
    assert "exited on signal 9" in status["reason"] and seconds < 60
    [record] = _restarts(trio, "used")
    assert record["kind"] == "died" and record["resume_step"] >= 10
    newest = max((trio.run_dir("used") / "checkpoints").glob("step_*.pt"))
    last = int(newest.name[5:13])
    assert torch.load(newest, weights_only=False)["step"] == last > record["resume_step"]
    shown = trio.fab("status").stdout
    assert "used: failed" in shown and f"restart 1: {record['time']} died" in shown


# Issue 30's lost node: no checkpoint between the start and the kill, a snapshot in every node's memory every 3 s.
SNAPSHOTS = 3.0
BETWEEN_CHECKPOINTS = f"{TINY} --checkpoint-every 1000 --checkpoint-minutes 30 --snapshot-seconds {SNAPSHOTS:g}"


def _snapshot_steps(cluster: Cluster, run: str, rank: int) -> set[int]:
    """The steps of the snapshots node `rank` holds in its own /run (its mount namespace: its sshd's)."""
    sshd = cluster.processes(rank, r"sshd")[0]
    listed = subprocess.run(
        ["nsenter", "-t", str(sshd), "-m", "ls", f"/run/gpu-cluster/snapshots/{run}"], capture_output=True, text=True
    )
    return {int(step) for step in re.findall(r"^snapshot_(\d+)\.pt$", listed.stdout, re.M)}  # not a write's temp file


def _held_by_survivors(cluster: Cluster, run: str, timeout: float = 60) -> int:
    """A step whose snapshot nodes 0 and 1 both hold, once they do."""
    deadline = time.monotonic() + timeout
    while not (_snapshot_steps(cluster, run, 0) & _snapshot_steps(cluster, run, 1)):
        assert time.monotonic() < deadline, f"no snapshot on both survivors: {cluster.run_status(run)}"
        time.sleep(0.2)
    return _beat(cluster, run)[0]


@pytest.mark.timed
def test_a_lost_node_drilled_the_run_finishes_on_two_from_their_snapshots_at_the_same_global_batch_and_loss(
    trio, baselines
):
    """Last in the file: node2 stays dead. `fab drill kill-node` kills every process of node2 (its /run, with
    its snapshot, goes with its mount namespace) between checkpoints: the drill's report (_drill_reports_it),
    the resume from the survivors' snapshots, the run's goodput account (_goodput_accounts_for_the_run) and
    what `--follow` showed of it (_follow_names_the_incident), all on this one run."""
    extra = BETWEEN_CHECKPOINTS
    argv = ["fab", "train", "--run", "lost", "--steps", str(STEPS), *RESTARTING, "--follow", "--extra", extra]
    follow = subprocess.Popen(argv, cwd=REPO, env=trio.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_beat(trio, "lost", 10)
        reached = _held_by_survivors(trio, "lost")
        drill = trio.fab("drill", "kill-node", "--wait", "120").stdout
        print(drill)
        status, finished = trio.wait_for_end("lost", timeout=60)
        out, _ = follow.communicate(timeout=60)
    finally:
        follow.kill()
    [record] = _restarts(trio, "lost")
    loss, base, other = _final_loss(trio, "lost"), baselines["1234"], baselines["99"]
    noise = max(2 * abs(base - other), 0.02)
    print(
        f"lost node: lost {record['steps_lost']} steps ({record['lost_s']} s) since step {record['resume_step']}; "
        f"run ended {finished:.1f} s after the drill; "
        f"final loss {loss:.3f} vs uninterrupted {base:.3f} (seed 99: {other:.3f}, tolerance {noise:.3f})"
    )
    assert status["state"] == "finished", status
    assert record["dropped"] == {trio_ip(trio, 2): "unreachable"} and len(record["nodes_after"]) == 2
    assert (record["global_batch"], record["batch_per_gpu"], record["grad_accum"]) == (24, 6, 2)
    assert abs(loss - base) <= noise
    _drill_reports_it(trio, drill, record)
    _goodput_accounts_for_the_run(trio, "lost", reached, record)
    log = (trio.run_dir("lost") / "train.log").read_text()
    _follow_names_the_incident(follow.returncode, out, log, trio.run_dir("lost"))


def _drill_reports_it(cluster: Cluster, out: str, record: dict) -> None:
    """`fab drill kill-node`'s report: the restart, the incident's timeline in order and the goodput lost; the
    resume from the survivors' memory (or, when mpirun's end cut one survivor's last write short, the other's
    snapshot copied to /data), losing at most one snapshot interval and the step it lands on (issue 30)."""
    ips = [trio_ip(cluster, rank) for rank in range(3)]
    head = rf"^drill kill-node on node2 \({re.escape(ips[2])}\), run /data/runs/lost at step (\d+): SIGKILL to its "
    struck = re.search(head, out, re.M)
    assert struck and int(struck.group(1)) < STEPS, f"the drill came too late for a {STEPS}-step run:\n{out}"
    assert "the supervisor restarted the run and it is stepping again" in out
    assert f"restart 1 ({record['kind']}): " in out and f"dropped {ips[2]} (unreachable)" in out
    times = {}
    for event in ("detected the failure", "decided", "launched attempt 2", "ready to step", "first step"):
        found = re.search(rf"^  \+([\d.]+) s  .*{event}", out, re.M)
        assert found, (event, out)
        times[event] = float(found.group(1))
    assert list(times.values()) == sorted(times.values()), times  # in the order they happened
    step, holder = record["resume_step"], record.get("resume_holder")
    assert record["resume_from"] == "snapshot" and step > 0 and record["lost_s"] <= SNAPSHOTS + 1, record
    assert f"restart from step {step}" in out
    names = {ips[0]: "node0", ips[1]: "node1"}
    where = f"{names[holder]}'s snapshot (copied to /data)" if holder else "the nodes' own snapshots"
    assert f"from {where} at step {step}; lost {record['steps_lost']} steps" in out, out
    log = (cluster.run_dir("lost") / "train.log").read_text()
    own = f"this node's snapshot /run/gpu-cluster/snapshots/lost/snapshot_{step:08d}.pt"
    copied = f"/data/runs/lost/checkpoints/step_{step:08d}.pt"
    assert f"resuming from {copied if holder else own} at step {step}" in log, log[-3000:]
    goodput_lost = r"^goodput lost: ([\d.]+) s \(.*restart\.detect ([\d.]+) s.*\) in the drill's ([\d.]+) s"
    lost = re.search(goodput_lost, out, re.M)
    # at least the detection; at most the drill's time plus the stepping since the snapshot
    assert lost and 0 < float(lost.group(2)) <= float(lost.group(1)), out
    assert float(lost.group(1)) <= float(lost.group(3)) + SNAPSHOTS + 1, out
    assert re.search(r"^incident \(\w+\): detected .* \d+ steps lost", out, re.M), out


def _follow_names_the_incident(code: int, out: str, log: str, run: Path) -> None:
    """What a user reads when a node is lost (issue 23, item 5): the follow output names the cause and the
    node by its inventory name and says what was lost; Open MPI's help text and the ranks' tracebacks stay
    in train.log (fab logs) and out of --follow."""
    print(f"--follow printed {len(out.splitlines())} lines:\n{out}")
    assert code == 0, out
    assert "node2 unreachable" in out
    assert re.search(rf"lost \d+ steps(, [\d.]+ s)? since .*: snapshots every {SNAPSHOTS:g} s", out), out
    assert "from step None" not in out and "{" not in out.split("restart 1/1")[-1].splitlines()[0]
    assert "PATH and LD_LIBRARY_PATH" not in out and "Traceback" not in out
    assert "mpirun: 3 ranks on node0,node1,node2 (spec attempt 1)" in out and "--allow-run-as-root" not in out
    # The raw output stays in the log.
    assert "--allow-run-as-root" in log or (run / "specs" / "attempt-1.json").exists()


def _goodput_accounts_for_the_run(cluster: Cluster, run: str, reached: int, record: dict) -> None:
    """The goodput account of the restarted run: the phases sum to the wall-clock, the steps lost are
    those after the last checkpoint, and fab report / fab runs show it."""
    acc = goodput.account(phases.read(cluster.run_dir(run)))
    [incident] = acc.incidents
    print("\n".join(goodput.lines(acc)))
    named = sum(v for k, v in acc.phases.items() if k != "unaccounted")
    assert abs(named - acc.wall_s) <= 0.05 * acc.wall_s, acc.phases
    detect = next(m for m in phases.read(cluster.run_dir(run)) if m.event == "detect")
    assert detect.step >= reached  # the ranks went on between our read and the kill
    assert incident.steps_lost == detect.step - record["resume_step"] >= 0  # none when a snapshot lands on it
    assert acc.steps_kept == STEPS and 0 < acc.goodput < 1
    summary = json.loads((cluster.run_dir(run) / "summary.json").read_text())["goodput"]  # the supervisor's
    assert summary["goodput"] == round(acc.goodput, 4) and summary["restarts"][0]["steps_lost"] == incident.steps_lost
    report = cluster.fab("report", "--run", run).stdout
    assert "goodput " in report and "restart 1 (" in report and (cluster.run_dir(run) / "goodput.png").exists()
    assert "goodput" in cluster.fab("runs").stdout.splitlines()[0]


def trio_ip(cluster: Cluster, rank: int) -> str:
    return json.loads(cluster.inventory.read_text())["nodes"][rank]["private_ip"]
