"""cluster_node.supervisor.loop without a cluster or a process: one test per transition of its table (design
§3.2), a Supervisor fed scripted observations, a fake mpirun and fake nodes; the issue's named cases: a hang,
a lost node, restarts used up, a stop and a forced stop during a restart, a Spot notice on its own node."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

import pytest
from supervisor_fixture import write_spec

from cluster_node.protocol import rundir, spec
from cluster_node.protocol.rundir import EndKind
from cluster_node.supervisor import restart_plan
from cluster_node.supervisor.loop import Outcome, State, Supervisor
from cluster_node.supervisor.observe import Observation

HEALTHY = json.dumps({"time": 0, "mounted": True, "writable": True, "free_gb": 100, "xids": [], "gpus": []})
NOW = 1_800_000_000.0


class FakeMpirun:
    def __init__(self, exits: list[Optional[int]]):
        self.exits, self.starts, self.ended = list(exits), [], 0

    def start(self, run_spec: spec.RunSpec) -> None:
        self.starts.append(run_spec)

    def wait(self, timeout: float) -> Optional[int]:
        return self.exits.pop(0) if self.exits else None

    def end(self) -> int:
        self.ended += 1
        return 143


class FakeNodes:
    def __init__(self, run: Path):
        self.run, self.calls = run, []

    def ssh_ok(self, host: str) -> bool:
        return True

    def cleanup(self, host: str) -> bool:
        self.calls.append(("cleanup", host))
        return True

    def collect_stacks(self, hosts) -> None:
        self.calls.append(("stacks", tuple(hosts)))

    def probe_all(self) -> None:
        self.calls.append(("probe",))
        (self.run / "probes").mkdir(exist_ok=True)
        for host in ("h1", "h2"):
            (self.run / "probes" / host).write_text(HEALTHY)

    stop_works = True
    copies: Optional[str] = None  # persist_snapshot's answer: the checkpoint's path, None a failed copy

    def persist_snapshot(self, host: str, step: int, size: int = 0) -> Optional[str]:
        self.calls.append(("persist", host, step))
        return self.copies

    def drop_snapshots(self, hosts) -> None:
        self.calls.append(("drop", tuple(hosts)))

    def then_stop(self, log_path) -> bool:
        self.calls.append(("then_stop", (self.run / "run-status.json").read_text()))
        return self.stop_works


class Script:
    """Each attempt's observer: the scripted observations, one per poll; then nothing new."""

    def __init__(self, *observations: Observation, notice: Optional[rundir.Interruption] = None):
        self.observations, self.notice, self.started = list(observations), notice, NOW - 1

    def __call__(self, run, run_spec, ssh_ok, clock):
        return self

    def observe(self, exited: Optional[int]) -> Observation:
        obs = self.observations.pop(0) if self.observations else Observation(NOW)
        return Observation(**{**obs.__dict__, "exited": exited, "own_notice": self.notice})

    def own_notice(self) -> Optional[rundir.Interruption]:
        return self.notice


def _supervisor(tmp_path: Path, exits, script: Script, restarts: int = 0, then_stop: bool = False):
    run_spec = write_spec(tmp_path, ["train.py"], ["h1", "h2"], max_restarts=restarts)
    run_spec = spec.RunSpec(**{**run_spec.__dict__, "names": {"h1": "node0", "h2": "node1"}})
    if then_stop:
        run_spec = spec.RunSpec(**{**run_spec.__dict__, "then_stop": spec.ThenStop(("stop",))})
    (tmp_path / "active").write_text(f"{tmp_path}\n")
    (tmp_path / "config.json").write_text(json.dumps({"batch_per_gpu": 8, "grad_accum": 1}))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step_00000030.pt").write_bytes(b"x")
    mpirun, nodes = FakeMpirun(exits), FakeNodes(tmp_path)
    return Supervisor(tmp_path, run_spec, mpirun, nodes, clock=lambda: NOW, observer=script), mpirun, nodes


def _status(run: Path) -> dict:
    return json.loads((run / "run-status.json").read_text())


def test_row1_2_the_first_attempt_starts_and_its_first_step_makes_it_running(tmp_path):
    sup, mpirun, _ = _supervisor(tmp_path, [None], Script(Observation(NOW, first_step=True)))
    sup.launch()
    assert sup.state == State.STARTING and mpirun.starts[0].attempt == 1
    assert sup.step() == State.RUNNING


def test_row3_no_step_before_the_start_limit_ends_the_attempt(tmp_path):
    sup, mpirun, _ = _supervisor(tmp_path, [None], Script(Observation(NOW, start_timeout=True)))
    assert sup.run_all() == 143 and mpirun.ended == 1
    status = _status(tmp_path)
    assert status["state"] == "failed" and status["reason"].startswith("watchdog: no training step within 900 s")


def test_row4_a_hang_collects_stacks_names_the_rank_and_keeps_them(tmp_path):
    sup, mpirun, nodes = _supervisor(tmp_path, [None], Script(Observation(NOW, first_step=True, hang=(70, 60))))
    (tmp_path / "ranks").mkdir()
    sup.launch()
    (tmp_path / "ranks" / "rank0").write_text("12 7 n0\n")
    sup.step()
    assert sup.state == State.STOPPING and ("stacks", ("h1", "h2")) in nodes.calls
    assert "hang: no rank finished a step for 70 s (window 60 s); rank 0 (pid 7 on n0) is behind" in sup.reason
    assert (tmp_path / "hang-stacks-1").is_dir() and json.loads((tmp_path / "hangs.json").read_text())[0]["rank"] == 0
    assert sup.step() == State.FAILED and mpirun.ended == 1


def test_row5_progress_that_stalls_ends_the_attempt_as_a_hang(tmp_path):
    sup, _, _ = _supervisor(tmp_path, [None], Script(Observation(NOW, first_step=True, stall=700)))
    sup.run_all()
    assert _status(tmp_path)["reason"] == "watchdog: no training progress for 700 s"


def test_row6_11_14_a_lost_node_ends_the_attempt_and_the_run_goes_on_without_it(tmp_path):
    script = Script(Observation(NOW, unreachable="h2"))
    sup, mpirun, nodes = _supervisor(tmp_path, [None, 0], script, restarts=1)
    (tmp_path / "train.log").write_text("run ended at step 40: max_steps\n")
    nodes.probe_all = lambda: (tmp_path / "probes").mkdir() or (tmp_path / "probes" / "h1").write_text(HEALTHY)
    assert sup.run_all() == 0
    second = mpirun.starts[1]
    assert second.attempt == 2 and second.hosts == ("h1",) and second.env["MASTER_ADDR"] == "h1"
    assert second.batch == spec.Batch(8, 2, 16) and spec.read(tmp_path) == second
    assert (tmp_path / "specs" / "attempt-1.json").exists() and (tmp_path / "specs" / "attempt-2.json").exists()
    [restart] = json.loads((tmp_path / "restarts.json").read_text())
    assert restart["dropped"] == {"h2": "unreachable"} and restart["resume_step"] == 30
    log = (tmp_path / "train.log").read_text()
    restarted = "restart 1/1 on 1 node(s) node0 from the checkpoint at step 30"
    assert f"watchdog: node1 unreachable (no ssh answer for 2+ s); {restarted}" in log
    assert "dropped node1 (unreachable)" in log and "{" not in log
    [shown] = restart_plan.history_lines([restart])
    assert "resumed from step 30 on 1 node(s) node0, dropped node1" in shown
    assert _status(tmp_path)["state"] == "finished" and ("cleanup", "h2") in nodes.calls


def _holding(run: Path, steps: dict) -> None:
    """The probes of nodes holding snapshots of this run (h2 lost /data: bad, but it answers)."""
    (run / "probes").mkdir(exist_ok=True)
    for host, step in steps.items():
        facts = {**json.loads(HEALTHY), "snapshots": {run.resolve().name: {"step": step, "bytes": 1}}}
        facts.update({"mounted": False} if host == "h2" else {})
        (run / "probes" / host).write_text(json.dumps(facts))


@pytest.mark.parametrize("copy_works", [True, False], ids=["copied", "copy-failed"])
def test_row14_a_snapshot_the_next_nodes_lack_is_copied_to_data_by_its_holder_first(tmp_path, copy_works):
    """Issue 30: node1 (/data gone, still answering) holds step 36, node0 step 35: node1 copies its snapshot into
    the checkpoints, and the restart on node0 resumes there; when the copy fails, from node0's own snapshot at
    35 (what its trainer will take: as new as the checkpoint at 30 or newer). The run's end frees the RAM."""
    sup, mpirun, nodes = _supervisor(tmp_path, [1, 0], Script(), restarts=1)
    (tmp_path / "train.log").write_text("rank 1 exited on signal 9\n")
    nodes.probe_all = lambda: _holding(tmp_path, {"h1": 35, "h2": 36})
    nodes.copies = str(tmp_path / "checkpoints" / "step_00000036.pt") if copy_works else None
    assert sup.run_all() == 0 and ("persist", "h2", 36) in nodes.calls and mpirun.starts[1].hosts == ("h1",)
    [restart] = json.loads((tmp_path / "restarts.json").read_text())
    log = (tmp_path / "train.log").read_text()
    if copy_works:
        assert "launcher: node1's snapshot at step 36 copied to " in log
        assert "from node1's snapshot at step 36, copied to /data" in log
        assert (restart["resume_step"], restart["resume_from"], restart["resume_holder"]) == (36, "snapshot", "h2")
    else:
        assert "copying node1's snapshot at step 36 to /data failed; the next newest state" in log
        assert "from the nodes' own snapshots at step 35" in log
        assert (restart["resume_step"], restart["resume_from"]) == (35, "snapshot") and "resume_holder" not in restart
    assert nodes.calls[-1] == ("drop", ("h1", "h2"))


def test_row14_survivors_that_all_hold_the_newest_snapshot_resume_from_their_memory_without_a_copy(tmp_path):
    script = Script(Observation(NOW, unreachable="h2"))
    sup, mpirun, nodes = _supervisor(tmp_path, [None, 0], script, restarts=1)
    nodes.probe_all = lambda: _holding(tmp_path, {"h1": 41})
    assert sup.run_all() == 0 and not [c for c in nodes.calls if c[0] == "persist"]
    log = (tmp_path / "train.log").read_text()
    assert "restart 1/1 on 1 node(s) node0 from the nodes' own snapshots at step 41" in log


def test_row13_a_stop_during_the_snapshots_copy_ends_the_run_before_any_relaunch(tmp_path):
    """The copy can take minutes: a `fab stop --force` meanwhile must not be followed by a new attempt."""
    sup, mpirun, nodes = _supervisor(tmp_path, [1], Script(), restarts=1)
    nodes.probe_all = lambda: _holding(tmp_path, {"h1": 35, "h2": 36})

    def copy_while_stopped(host: str, step: int, size: int = 0) -> Optional[str]:
        (tmp_path / "FORCED").touch()
        return str(tmp_path / "checkpoints" / "step_00000036.pt")

    nodes.persist_snapshot = copy_while_stopped
    sup.run_all()
    assert len(mpirun.starts) == 1 and _status(tmp_path)["reason"] == "stopped by fab stop --force"
    assert not [c for c in nodes.calls if c[0] == "drop"]  # a failed run keeps its snapshots for a resume


def test_row13_a_graceful_stop_during_a_restart_keeps_the_nodes_snapshots(tmp_path):
    """Stopped during a restart: resumable from the newest state, which the nodes' snapshots may hold (36, the
    checkpoint 30): `fab train --run NAME` resumes from them; freeing them is for a run ended at a checkpoint."""
    sup, mpirun, nodes = _supervisor(tmp_path, [1], Script(), restarts=1)
    nodes.probe_all = lambda: _holding(tmp_path, {"h1": 36, "h2": 36}) or (tmp_path / "STOP").write_text("fab stop")
    sup.run_all()
    assert _status(tmp_path)["state"] == "stopped" and len(mpirun.starts) == 1
    assert not [c for c in nodes.calls if c[0] == "drop"]


def test_a_node_reached_again_is_not_named_unreachable_by_a_later_attempts_failure(tmp_path):
    """A fresh read (session 30): h2 unreachable at attempt 1's clean-up (a Spot stop, a partition), back and
    healthy at the probe, so attempt 2 runs on it; attempt 2 dies with h2 reached: that is a death, not h2."""
    sup, mpirun, nodes = _supervisor(tmp_path, [1, 1, 0], Script(), restarts=2)
    cleanups = iter([True, False])  # h1, h2 at attempt 1; then every host answers
    nodes.cleanup = lambda host: next(cleanups, True)
    (tmp_path / "train.log").write_text("[1,1]<stderr>:RuntimeError: CUDA error: an illegal memory access\n")
    sup.run_all()
    kinds = [entry["kind"] for entry in json.loads((tmp_path / "restarts.json").read_text())]
    assert [s.hosts for s in mpirun.starts] == [("h1", "h2"), ("h1", "h2"), ("h1", "h2")]
    assert kinds == ["unreachable", "died"] and _status(tmp_path)["state"] == "finished"


def test_row7_a_forced_stop_ends_the_run_failed(tmp_path):
    sup, mpirun, _ = _supervisor(tmp_path, [143], Script(), restarts=1)
    (tmp_path / "FORCED").touch()
    sup.run_all()
    assert _status(tmp_path)["reason"] == "stopped by fab stop --force" and len(mpirun.starts) == 1


def _trainer_ended(run: Path, step: int, ended: str, ended_by: Optional[str]) -> None:
    """The trainer's last words: its log line and progress.json's end record (callbacks.ProgressFile)."""
    with open(run / "train.log", "a") as log:
        log.write(f"x\n[1,0]<stdout>:run ended at step {step}: {ended}\n")
    end = rundir.Progress(step=step, max_steps=100, loss=None, ended=ended, ended_by=ended_by)
    rundir.write_record(run / "progress.json", end)


def test_row8_a_clean_end_is_finished_with_the_trainers_last_line(tmp_path):
    sup, _, _ = _supervisor(tmp_path, [0], Script())
    _trainer_ended(tmp_path, 50, "max_steps", "steps")
    assert sup.run_all() == 0
    status = _status(tmp_path)
    assert status["state"] == "finished" and status["reason"] == "run ended at step 50: max_steps"
    assert "kind" not in status and not (tmp_path / "active").exists()


def test_row8_a_stop_the_trainer_honoured_ends_stopped_as_its_end_record_says(tmp_path):
    """The end record's `ended_by` decides, not its words: `stopped` (resumable) for a stop, `finished` for a
    target reached whatever the words; a record from before `ended_by` is read by its words."""
    for ended, ended_by, state in (
        ("stop requested (checkpoint now, no eval)", "stop", "stopped"),
        ("stop requested by the target", "target", "finished"),
        ("stop requested (checkpoint now, no eval)", None, "stopped"),
        ("max_steps", None, "finished"),
    ):
        run = tmp_path / f"{ended_by}-{len(ended)}"
        run.mkdir()
        sup, _, _ = _supervisor(run, [0], Script())
        _trainer_ended(run, 40, ended, ended_by)
        sup.run_all()
        status = _status(run)
        assert (status["state"], status["reason"]) == (state, f"run ended at step 40: {ended}"), ended_by


def _notice(run: Path, host: str, action_time: str = "") -> rundir.Interruption:
    entry = rundir.Interruption(node=0 if host == "h1" else 1, host=host, action="stop", noticed="")
    entry = rundir.Interruption(**{**entry.__dict__, "action_time": action_time})
    entry = rundir.Interruption(**{**entry.__dict__, "noticed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    rundir.append(run / "interruptions.json", entry)
    return entry


@pytest.mark.parametrize("whose", ["worker", "head-unrecorded", "fab-stop", "fab-stop-after-a-notice"])
def test_row13_a_workers_spot_notice_during_a_restart_leaves_it_out_and_the_run_goes_on(tmp_path, whose):
    """A fresh read (session 30): attempt 1 died; while the nodes were probed h2's watcher wrote its STOP and its
    notice (Spot reclaims come in waves). The run ended "stopped during a restart" (and with --then-stop stopped
    every node) though h1 could go on. A worker's recorded notice is now no reason to end: the plan drops h2 and
    the STOP is taken back; the head's own notice not yet recorded, or any other STOP, still ends the run."""
    script = Script()
    script.started = 0
    sup, mpirun, nodes = _supervisor(tmp_path, [1, 0], script, restarts=1)
    said = {
        "worker": "now: spot: node1 (i-2) will stop at 2030-01-01T00:00:00Z",
        "head-unrecorded": "now: spot: node0 (i-1) will stop at 2030-01-01T00:00:00Z",
        "fab-stop": "",
        "fab-stop-after-a-notice": "now: spot: node1 (i-2) will stop at 2030-01-01T00:00:00Z\nfab stop",
    }[whose]

    def probe_during_a_notice() -> None:
        FakeNodes.probe_all(nodes)
        if whose in ("worker", "fab-stop-after-a-notice"):
            _notice(tmp_path, "h2", "2030-01-01T00:00:00Z")  # recorded first, then the STOP (spotwatch.handle)
        (tmp_path / "STOP").write_text(said + "\n")

    nodes.probe_all = probe_during_a_notice
    sup.run_all()
    if whose == "worker":
        assert [s.hosts for s in mpirun.starts] == [("h1", "h2"), ("h1",)] and not (tmp_path / "STOP").exists()
        assert json.loads((tmp_path / "restarts.json").read_text())[0]["dropped"] == {
            "h2": "Spot stop at 2030-01-01T00:00:00Z"
        }
        assert (
            "launcher: a Spot notice during the restart (now: spot: node1 (i-2) will stop"
            in (tmp_path / "train.log").read_text()
        )
    else:
        assert len(mpirun.starts) == 1 and _status(tmp_path)["state"] == "stopped"
        assert not (tmp_path / "STOP.taken").exists()
    if whose == "fab-stop-after-a-notice":  # taken aside, then put back: fab stop's line is not lost
        assert "fab stop" in (tmp_path / "STOP").read_text().splitlines()


@pytest.mark.parametrize("forced", [False, True], ids=["notice", "notice-then-forced"])
def test_row14_a_workers_notice_that_lands_while_the_restart_is_planned_is_planned_again_without_it(tmp_path, forced):
    """The review of the fix above: the plan (h1, h2) was made, h2's snapshot was being copied to /data (minutes),
    and h2's notice landed then: its STOP was taken back, and the next attempt must not run on h2 all the same."""
    script = Script()
    script.started = 0
    sup, mpirun, nodes = _supervisor(tmp_path, [1, 0], script, restarts=1)

    def both_healthy_h2_newest() -> None:
        (tmp_path / "probes").mkdir(exist_ok=True)
        for host, step in {"h1": 35, "h2": 36}.items():
            facts = {**json.loads(HEALTHY), "snapshots": {tmp_path.resolve().name: {"step": step, "bytes": 1}}}
            (tmp_path / "probes" / host).write_text(json.dumps(facts))

    copies = []

    def copy_then_noticed(host: str, step: int, size: int = 0) -> Optional[str]:
        copies.append(host)
        if len(copies) == 1:
            _notice(tmp_path, "h2", "2030-01-01T00:00:00Z")
            (tmp_path / "STOP").write_text("now: spot: node1 (i-2) will stop at 2030-01-01T00:00:00Z\n")
        elif forced:
            (tmp_path / "FORCED").touch()  # `fab stop --force` while the second plan copies
        return str(tmp_path / "checkpoints" / "step_00000036.pt")  # copied: the first plan stands as made

    nodes.probe_all, nodes.persist_snapshot = both_healthy_h2_newest, copy_then_noticed
    sup.run_all()
    if forced:  # a stop while planning again wins as it does the first time
        assert len(mpirun.starts) == 1 and _status(tmp_path)["reason"] == "stopped by fab stop --force"
        return
    assert [s.hosts for s in mpirun.starts] == [("h1", "h2"), ("h1",)] and not (tmp_path / "STOP").exists()


def test_row9_a_spot_notice_on_another_node_restarts_without_it(tmp_path):
    script = Script()
    script.started = 0  # the notice came during the attempt
    sup, mpirun, _ = _supervisor(tmp_path, [0, 0], script, restarts=1)
    _notice(tmp_path, "h2")
    (tmp_path / "progress.json").write_text(json.dumps({"step": 30}))
    sup.run_all()
    assert [s.hosts for s in mpirun.starts] == [("h1", "h2"), ("h1",)]
    assert json.loads((tmp_path / "restarts.json").read_text())[0]["kind"] == "spot"


def test_row10_a_rank_that_dies_fails_the_run_without_restarts(tmp_path):
    sup, _, nodes = _supervisor(tmp_path, [1], Script())
    (tmp_path / "train.log").write_text("RuntimeError: boom\n")
    assert sup.run_all() == 1
    status = _status(tmp_path)
    assert (status["state"], status["reason"], status["kind"]) == ("failed", "RuntimeError: boom", "died")
    assert ("cleanup", "h1") in nodes.calls


def test_row12_a_forced_stop_during_a_restart_launches_nothing(tmp_path):
    sup, mpirun, nodes = _supervisor(tmp_path, [1], Script(), restarts=2)
    nodes.probe_all = lambda: (tmp_path / "FORCED").touch()  # fab stop --force while the nodes are probed
    sup.run_all()
    assert len(mpirun.starts) == 1 and _status(tmp_path)["reason"] == "stopped by fab stop --force"


def test_row13_a_stop_during_a_restart_ends_the_run_at_its_checkpoint(tmp_path):
    sup, mpirun, _ = _supervisor(tmp_path, [1], Script(), restarts=2)
    (tmp_path / "STOP").touch()
    sup.run_all()
    status = _status(tmp_path)
    assert len(mpirun.starts) == 1 and status["state"] == "stopped"  # resumable (issue 23 item 3)
    assert status["reason"].startswith("stopped during a restart at checkpoint 30")


def test_row15_restarts_used_up_fail_the_run_and_say_why(tmp_path):
    sup, mpirun, _ = _supervisor(tmp_path, [1, 1], Script(), restarts=1)
    (tmp_path / "train.log").write_text("RuntimeError: boom\n")
    sup.run_all()
    status = _status(tmp_path)
    assert len(mpirun.starts) == 2 and status["state"] == "failed"
    assert "RuntimeError: boom" in status["reason"] and status["reason"].endswith("; restarts exhausted (1/1)")


def test_row16_a_spot_notice_for_its_own_node_ends_resumable_and_never_relaunches(tmp_path):
    action = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW + 120))
    notice = rundir.Interruption(node=0, host="h1", action="stop", action_time=action, noticed="x")
    # The trainer checkpointed (spotwatch wrote STOP now) and mpirun ended by itself.
    sup, mpirun, _ = _supervisor(tmp_path, [None, 0], Script(notice=notice), restarts=2)
    sup.run_all()
    status = _status(tmp_path)
    assert len(mpirun.starts) == 1 and mpirun.ended == 0 and status["state"] == "failed"
    assert status["kind"] == "spot" and status["resume"] == f"fab train --run {tmp_path.name}"
    assert status["reason"].startswith(f"spot: node0 (h1) will stop at {action}; checkpoint step 30; resumable")
    # fab reaches the cluster through node0: the reason gives the order (a fresh read of the deploy path)
    assert "resumable, once EC2 starts it again: `fab inventory`, then fab train --run" in status["reason"]
    assert not (tmp_path / "active").exists()


def test_row16_mpirun_still_going_near_the_action_time_is_ended(tmp_path):
    action = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW + 20))  # inside the 30 s margin
    notice = rundir.Interruption(node=0, host="h1", action="terminate", action_time=action, noticed="x")
    sup, mpirun, _ = _supervisor(tmp_path, [None, None], Script(notice=notice))
    sup.run_all()
    status = _status(tmp_path)
    assert mpirun.ended == 1 and status["state"] == "finished" and status["exit_code"] == 143
    assert "--exclude 0 --extra '--batch-per-gpu 8 --grad-accum 2 --keep-global-batch 16'" in status["resume"]


def test_row17_then_stop_runs_after_the_final_status_which_says_so(tmp_path):
    """Stopping the instances may end the supervisor with its node (a fresh read of the deploy path):
    the final status and .active are written first, then the stop request."""
    sup, _, nodes = _supervisor(tmp_path, [0], Script(), then_stop=True)
    sup.run_all()
    [(_, status_then)] = [c for c in nodes.calls if c[0] == "then_stop"]
    written = json.loads(status_then)
    assert written["state"] == "finished" and written["reason"].endswith("then-stop: stopping the cluster")
    assert written["then_stop"] == "stopping"  # a follower waits for the outcome (fab logs --follow)
    assert _status(tmp_path) == {**written, "then_stop": "sent", "time": _status(tmp_path)["time"]}


def test_row17_a_failed_then_stop_is_in_the_final_status(tmp_path):
    sup, _, nodes = _supervisor(tmp_path, [0], Script(), then_stop=True)
    nodes.stop_works = False
    sup.run_all()
    final = _status(tmp_path)
    assert final["then_stop"] == "failed" and final["reason"].endswith(
        "then-stop: stopping the cluster failed: the cluster keeps running"
    )


def test_a_supervisor_that_crashes_ends_mpirun_and_leaves_a_failed_status(tmp_path):
    """A bug in the supervisor left the run `running` for ever and mpirun orphaned."""
    sup, mpirun, _ = _supervisor(tmp_path, [None], Script())
    sup.launch()
    sup.crashed(FileExistsError("[Errno 17] File exists: 'ranks'"))
    status = _status(tmp_path)
    assert status["state"] == "failed" and status["reason"].startswith("supervisor crashed (FileExistsError")
    assert mpirun.ended


def test_a_launch_logs_one_short_line_with_the_node_names_and_the_whole_mpirun_line_elsewhere(tmp_path, capsys):
    sup, _, _ = _supervisor(tmp_path, [None], Script())
    sup.launch()
    log = (tmp_path / "train.log").read_text()
    assert log.endswith(" mpirun: 2 ranks on node0,node1 (spec attempt 1)\n") and "mpirun --allow" not in log
    assert "attempt 1: mpirun --allow-run-as-root -np 2 -H h1:1,h2:1" in capsys.readouterr().out  # launcher.log


def test_a_died_attempt_with_a_node_the_cleanup_cannot_reach_names_that_node(tmp_path):
    sup, _, nodes = _supervisor(tmp_path, [1], Script(), restarts=1)
    nodes.cleanup = lambda host: host != "h2"
    (tmp_path / "train.log").write_text("[rank0]: RuntimeError: gloo ... Connection reset by peer\n")
    sup.launch()
    assert sup.step() == State.RESTARTING
    assert (sup.reason, sup.kind) == ("node1 unreachable (mpirun exited with 1)", "unreachable")


def test_the_restart_line_says_what_was_lost_since_the_start_and_why(tmp_path):
    sup, _, _ = _supervisor(tmp_path, [None], Script(Observation(NOW, unreachable="h2")), restarts=1)
    sup.launch()
    (tmp_path / "checkpoints" / "step_00000030.pt").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"batch_per_gpu": 8, "grad_accum": 1, "checkpoint_every": 100}))
    (tmp_path / "ranks" / "rank0").write_text("55 1 n0\n")
    (tmp_path / "ranks" / "rank1").write_text("54 2 n1\n")
    for expected in (State.STOPPING, State.RESTARTING, State.STARTING):
        sup.step()
        assert sup.state == expected
    line = (tmp_path / "train.log").read_text().splitlines()[-2]
    assert "restart 1/1 on 2 node(s) node0 node1 from the start (lost 55 steps since the start: the recipe" in line
    assert "checkpoints every 100 steps)" in line


def test_row17_the_retried_cleanup_of_a_dropped_node_spares_a_run_started_during_its_pause(tmp_path, monkeypatch):
    """Found by `fab drill kill-node`/`cut-link`: the next `fab train`, started while the ended run's
    supervisor paused between clean-up retries, lost its MPI daemon on the node that came back (pkill orted)."""
    from cluster_node.supervisor import loop as module

    run_spec = write_spec(tmp_path, ["train.py"], ["h1", "h2"], cleanup=60.0)
    nodes = FakeNodes(tmp_path)
    sup = Supervisor(tmp_path, run_spec, FakeMpirun([]), nodes, clock=lambda: NOW, observer=Script())
    sup.unreached.add("h2")
    active = tmp_path / "active"
    active.write_text("")
    monkeypatch.setattr(module.time, "sleep", lambda s: active.write_text("/data/runs/next\n"))  # fab train, meanwhile
    sup.retry_cleanup(active)
    assert ("cleanup", "h2") not in nodes.calls


def test_a_decision_is_a_frozen_outcome_the_loop_applies(tmp_path):
    """Issue 31: the outcome was five attributes each decision set piecemeal; now one value per decision."""
    sup, _, _ = _supervisor(tmp_path, [None], Script(), restarts=1)
    sup.launch()
    (tmp_path / "train.log").write_text("RuntimeError: boom\n")
    outcome = sup.decide(Observation(NOW, exited=1))
    assert outcome == Outcome(State.RESTARTING, EndKind.DIED, "RuntimeError: boom", 1)
    assert (sup.state, sup.kind, sup.code) == (State.STARTING, None, 0)  # decided, not applied
    with pytest.raises(dataclasses.FrozenInstanceError):
        outcome.reason = "changed"  # type: ignore[misc]
    assert sup.apply(outcome) == State.RESTARTING and (sup.kind, sup.reason, sup.code) == ("died", outcome.reason, 1)


def test_a_run_that_finishes_after_a_restart_has_no_kind_in_its_status(tmp_path):
    """A clean end has no kind (run-status.json's contract); the restart's kind outlived it: `died` on a
    finished run. restarts.json keeps the restart's."""
    sup, mpirun, _ = _supervisor(tmp_path, [1, 0], Script(), restarts=1)
    (tmp_path / "train.log").write_text("RuntimeError: boom\n")
    _trainer_ended(tmp_path, 60, "max_steps", "steps")
    assert sup.run_all() == 0 and len(mpirun.starts) == 2
    status = _status(tmp_path)
    assert status["state"] == "finished" and "kind" not in status, status
    assert json.loads((tmp_path / "restarts.json").read_text())[0]["kind"] == "died"
