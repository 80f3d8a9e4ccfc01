"""fab train --max-restarts without a cluster: the restart decisions (cluster_node.supervisor.restart_plan, hang), the
trainer's --keep-global-batch, and the real supervisor restarting a job on the nodes a stand-in ssh
still reaches."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from supervisor_fixture import STANDINS, status, supervise, write_spec

from cluster_node.protocol import spec
from cluster_node.supervisor import hang, restart_plan
from clusterops.nodes import health
from clusterops.run import launch
from train import config as train_config

HEALTHY = json.dumps(
    {"time": 0, "mounted": True, "writable": True, "free_gb": 100, "xids": [], "gpus": [], "torch": "2"}
)


def test_rebalance_keeps_the_global_batch_with_micro_batches_no_larger_than_before():
    assert restart_plan.rebalance(24, 2, 8) == (6, 2)  # 3 ranks x 8 -> 2 ranks x 6 x 2
    assert restart_plan.rebalance(24, 3, 8) == (8, 1)  # the node rejoined: back to the original shape
    assert restart_plan.rebalance(24, 5, 8) is None  # 24 does not split over 5 ranks
    # A --max-tokens run's micro-batch is its token budget whatever batch_per_gpu says: only the accumulation moves.
    assert restart_plan.rebalance(24, 1, 8, fixed=True) == (8, 3)
    assert restart_plan.rebalance(24, 6, 8, fixed=True) is None  # 4 each: half a token budget, not the same step


def _run_dir(tmp_path: Path, hosts: list[str], restarts: int = 1, min_nodes: int = 1) -> tuple[Path, spec.RunSpec]:
    program = ["python", "train.py", "--batch-per-gpu", "8"]
    run_spec = write_spec(tmp_path, program, hosts, max_restarts=restarts, min_nodes=min_nodes)
    (tmp_path / "config.json").write_text(json.dumps({"batch_per_gpu": 8, "grad_accum": 1}))
    (tmp_path / "probes").mkdir()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step_00000020.pt").write_bytes(b"x")
    return tmp_path, run_spec


def _plan(run: Path, run_spec: spec.RunSpec, kind: str, reason: str, since: float = 0.0):
    """restart_plan.plan, and what the supervisor does with a restart: the entry appended, the spec kept."""
    plan = restart_plan.plan(run, run_spec, kind, reason, since=since)
    if plan.spec is not None and plan.record is not None:
        restart_plan.rundir.append(run / "restarts.json", plan.record)
    return plan.spec is not None, plan.line, plan.spec or run_spec


def test_plan_drops_the_unreachable_node_and_rewrites_the_job_for_the_rest(tmp_path):
    run, run_spec = _run_dir(tmp_path, ["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    for host in ("10.0.0.1", "10.0.0.2"):
        (run / "probes" / host).write_text(HEALTHY + "\n")
    (run / "probes" / "10.0.0.3").write_text("")  # ssh failed: no output
    restart, line, run_spec = _plan(run, run_spec, "died", "rank 2 exited on signal 9")
    assert restart, line
    assert "restart 1/1 on 2 node(s)" in line and "from the checkpoint at step 20" in line
    assert run_spec.hosts == ("10.0.0.1", "10.0.0.2") and run_spec.process_env == {"HWLOC_COMPONENTS": "-gl"}
    command = " ".join(run_spec.argv())
    assert command.startswith("mpirun --allow-run-as-root -np 2 -H 10.0.0.1:1,10.0.0.2:1 ")
    assert "--batch-per-gpu 6" in command and "--grad-accum 2 --keep-global-batch 24" in command
    [record] = json.loads((run / "restarts.json").read_text())
    assert record["dropped"] == {"10.0.0.3": "unreachable"} and record["resume_step"] == 20
    assert record["nodes_after"] == ["10.0.0.1", "10.0.0.2"] and record["kind"] == "died"
    # Restarts are used up: the next failure gives up, and says why.
    restart, line, _ = _plan(run, run_spec, "died", "again")
    assert not restart and line == "restarts exhausted (1/1)"


def test_a_node_that_is_healthy_again_rejoins_at_the_next_restart(tmp_path):
    run, run_spec = _run_dir(tmp_path, ["10.0.0.1", "10.0.0.2", "10.0.0.3"], restarts=2)
    (run / "probes" / "10.0.0.1").write_text(HEALTHY)
    (run / "probes" / "10.0.0.2").write_text(HEALTHY)
    restart, _, run_spec = _plan(run, run_spec, "died", "node 3 lost")
    assert restart
    (run / "probes" / "10.0.0.3").write_text(HEALTHY)
    restart, line, run_spec = _plan(run, run_spec, "hang", "rank 0 stopped")
    assert restart, line
    second = json.loads((run / "restarts.json").read_text())[-1]
    assert second["rejoined"] == ["10.0.0.3"] and (second["batch_per_gpu"], second["grad_accum"]) == (8, 1)
    assert "-np 3" in " ".join(run_spec.argv())
    assert "rejoined 10.0.0.3" in restart_plan.history_lines(json.loads((run / "restarts.json").read_text()))[1]


def _holds(run: Path, host: str, step: int | None, bad: bool = False) -> None:
    """The probe of a node holding a snapshot of this run at `step` (cluster_node.programs.snapshots.held)."""
    facts = json.loads(HEALTHY)
    facts["snapshots"] = {run.resolve().name: {"step": step, "bytes": 1}} if step is not None else {}
    facts["mounted"] = not bad
    (run / "probes" / host).write_text(json.dumps(facts) + "\n")


def _beats(run: Path, step: int, step_time: float = 0.5) -> None:
    (run / "ranks").mkdir(exist_ok=True)
    (run / "ranks" / "rank0").write_text(f"{step} 1 node0\n")
    (run / "progress.json").write_text(json.dumps({"step": step - 2, "avg_step_time_s": step_time}))
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "snapshot_seconds": 60, "checkpoint_every": 1000}))


@pytest.mark.parametrize(
    "held, resumed, source, holder",
    [
        ({"10.0.0.1": 412, "10.0.0.2": 412}, 412, "snapshot", None),  # both survivors: their own memory
        ({"10.0.0.1": 412, "10.0.0.2": 400}, 412, "snapshot", "10.0.0.1"),  # a write cut short on one: copied
        ({"10.0.0.2": 412}, 412, "snapshot", "10.0.0.2"),  # node1's RAM went with a reboot: copied
        ({"10.0.0.1": 15, "10.0.0.2": 15}, 20, "checkpoint", None),  # older than the checkpoint
        ({"10.0.0.1": 20, "10.0.0.2": 20}, 20, "snapshot", None),  # a tie: the trainer reads RAM, not /data
        ({"10.0.0.1": 9000, "10.0.0.2": 9000}, 20, "checkpoint", None),  # past the last step: an older run's
        ({}, 20, "checkpoint", None),  # --snapshot-seconds 0
    ],
    ids=["all-hold", "steps-differ", "one-holds", "older", "tie", "older-runs-name", "none"],
)
def test_a_restart_resumes_from_the_newest_state_a_node_holds(tmp_path, held, resumed, source, holder):
    """Issue 30: node3 is lost at step 415; the survivors' probes say which snapshot each holds."""
    run, run_spec = _run_dir(tmp_path, ["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    _beats(run, 415)
    for host in ("10.0.0.1", "10.0.0.2"):
        _holds(run, host, held.get(host))
    plan = restart_plan.plan(run, run_spec, restart_plan.rundir.EndKind.DIED, "node3 lost")
    assert plan.point is not None and plan.record is not None, plan.line
    assert (plan.point.step, plan.point.source, plan.point.holder) == (resumed, source, holder)
    record = plan.record.to_json()
    assert record["resume_step"] == resumed and record["steps_lost"] == 415 - resumed
    assert record["lost_s"] == pytest.approx((415 - resumed) * 0.5)
    where = (
        f"{holder}'s snapshot at step 412, copied to /data" if holder else f"the nodes' own snapshots at step {resumed}"
    )
    if source == "snapshot":
        assert f"from {where} (lost {415 - resumed} steps, {(415 - resumed) * 0.5:.1f} s since {where}" in plan.line
        assert "snapshots every 60 s" in plan.line and record.get("resume_holder") == holder
        shown = restart_plan.history_lines([record])[0]
        assert (f"{holder}'s snapshot (copied to /data) at step" if holder else "the nodes' snapshots at step") in shown
    else:
        assert f"from the checkpoint at step 20 (lost {415 - 20} steps" in plan.line
        assert "the recipe checkpoints every 1000 steps" in plan.line and record["resume_from"] == "checkpoint"


def test_a_dropped_node_that_still_answers_gives_its_snapshot_and_without_the_copy_the_next_newest(tmp_path):
    """A node with a bad verdict (here /data unmounted) trains no more, but its RAM holds the newest state;
    when that copy fails, the step the next nodes all hold (what their trainer will take), not the checkpoint."""
    run, run_spec = _run_dir(tmp_path, ["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    _beats(run, 415)
    _holds(run, "10.0.0.1", 400)
    _holds(run, "10.0.0.2", 400)
    _holds(run, "10.0.0.3", 412, bad=True)
    plan = restart_plan.plan(run, run_spec, restart_plan.rundir.EndKind.DIED, "x")
    assert plan.point == restart_plan.ResumePoint(412, "snapshot", "10.0.0.3", bytes=1)
    assert plan.spec is not None and plan.spec.hosts == ("10.0.0.1", "10.0.0.2")
    fallback = restart_plan.plan(run, run_spec, restart_plan.rundir.EndKind.DIED, "x", copy=False)
    assert fallback.point == restart_plan.ResumePoint(400, "snapshot") and fallback.record
    assert fallback.record.resume_step == 400 and fallback.record.steps_lost == 15


def test_snapshots_of_a_run_that_takes_none_or_past_the_first_attempts_steps_are_not_its_state(tmp_path):
    """Issue 30, a second read: a run with --snapshot-seconds 0 reads no snapshot, so one its nodes hold is an
    older run's of the name; past the last heartbeat only at the first restart (later attempts' heartbeats
    start over, and lag)."""
    run, run_spec = _run_dir(tmp_path, ["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    _beats(run, 415)
    for host in ("10.0.0.1", "10.0.0.2"):
        _holds(run, host, 412)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "snapshot_seconds": 0}))
    plan = restart_plan.plan(run, run_spec, restart_plan.rundir.EndKind.DIED, "x")
    assert plan.point == restart_plan.ResumePoint(20)
    (run / "config.json").write_text(json.dumps(config))
    _beats(run, 410)  # the second attempt's heartbeats, behind the snapshot its nodes took in the first
    restart_plan.rundir.append(run / "restarts.json", plan.record)
    hosts = ("10.0.0.1", "10.0.0.2")
    assert restart_plan.resume_point(run, run_spec.pool, hosts) == restart_plan.ResumePoint(412, "snapshot")


def test_plan_gives_up_below_min_nodes_and_on_a_bad_node_verdict(tmp_path):
    run, run_spec = _run_dir(tmp_path, ["10.0.0.1", "10.0.0.2"], min_nodes=2)
    (run / "probes" / "10.0.0.1").write_text(HEALTHY)
    (run / "probes" / "10.0.0.2").write_text(HEALTHY.replace('"mounted": true', '"mounted": false'))
    restart, line, _ = _plan(run, run_spec, "died", "x")
    assert not restart and "1 healthy node(s) left, --min-nodes 2" in line and "/data is not mounted" in line
    assert not (run / "restarts.json").exists() and spec.read(run) == run_spec


def _notice(run: Path, host: str, noticed: float) -> None:
    entry = {"node": 1, "instance_id": "i-0node1", "host": host, "action": "stop", "action_time": "T+2min"}
    entry["noticed"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(noticed))
    (run / "interruptions.json").write_text(json.dumps([entry]))


def test_a_spot_notice_leaves_its_node_out_of_the_restart_while_it_still_answers(tmp_path):
    run, run_spec = _run_dir(tmp_path, ["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    hosts = run_spec.hosts
    for host in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        (run / "probes" / host).write_text(HEALTHY)  # the noticed node is healthy for two more minutes
    (run / "config.json").write_text(json.dumps({"batch_per_gpu": 8, "grad_accum": 1, "max_steps": 100}))
    (run / "progress.json").write_text(json.dumps({"step": 20}))
    attempt_started = time.time() - 30
    _notice(run, "10.0.0.2", noticed=attempt_started - 60)  # an earlier attempt's: not this one's
    assert restart_plan.spot_ended(run, hosts, attempt_started) is None
    _notice(run, "10.0.0.2", noticed=attempt_started + 10)
    why = restart_plan.spot_ended(run, hosts, attempt_started)
    assert why == "spot notice: 10.0.0.2: Spot stop at T+2min"
    restart, line, _ = _plan(run, run_spec, "spot", why, since=attempt_started)
    assert restart and "restart 1/1 on 2 node(s) 10.0.0.1 10.0.0.3 from the checkpoint at step 20" in line, line
    [record] = json.loads((run / "restarts.json").read_text())
    assert record["kind"] == "spot" and record["dropped"] == {"10.0.0.2": "Spot stop at T+2min"}
    # A run that reached its last step is done, notice or not.
    (run / "progress.json").write_text(json.dumps({"step": 100}))
    assert restart_plan.spot_ended(run, hosts, attempt_started) is None


def test_the_rank_behind_is_the_stopped_one_without_a_stack(tmp_path):
    (tmp_path / "ranks").mkdir()
    (tmp_path / "stacks").mkdir()
    for rank, (step, pid) in enumerate([(41, 100), (41, 200), (41, 300)]):
        (tmp_path / "ranks" / f"rank{rank}").write_text(f"{step} {pid} node{rank}\n")
        (tmp_path / "stacks" / f"rank{rank}.txt").write_text("" if rank == 1 else 'File "trainer.py", line 1\n')
    (tmp_path / "stacks" / "states.10.0.0.2").write_text("200 T\n")
    (tmp_path / "stacks" / "states.10.0.0.1").write_text("100 S\n300 S\n")
    rank, evidence = hang.behind(tmp_path)
    assert rank == 1 and "pid 200 on node1" in evidence and "(stopped)" in evidence and "no stack dump" in evidence


def test_two_nodes_ranks_that_share_a_pid_keep_their_own_states(tmp_path):
    """Each node's container has a PID namespace of its own, so ranks on two nodes can share a pid. Before,
    the states were keyed by pid alone: one node's line hid the other's, and the stopped rank was missed."""
    (tmp_path / "ranks").mkdir()
    (tmp_path / "stacks").mkdir()
    for rank, (step, host) in enumerate([(3, "ip-10-0-0-5"), (5, "ip-10-0-0-6")]):
        (tmp_path / "ranks" / f"rank{rank}").write_text(f"{step} 2345 {host}\n")
        (tmp_path / "stacks" / f"rank{rank}.txt").write_text('File "trainer.py", line 1\n')  # rank 1's: py-spy
    (tmp_path / "stacks" / "states.10.0.0.5").write_text("2345 S ip-10-0-0-5\n")
    (tmp_path / "stacks" / "states.10.0.0.6").write_text("2345 T ip-10-0-0-6\n")
    rank, evidence = hang.behind(tmp_path)
    assert rank == 1 and "pid 2345 on ip-10-0-0-6" in evidence and "process state T (stopped)" in evidence


def test_a_hang_dump_finds_the_ranks_not_their_forked_workers(tmp_path):
    """A ResNet rank's DataLoader workers are forks with its command line: the dump took them for ranks
    (~180 processes on a p4d, each py-spied and signalled within the dump's 15 s). A launcher whose command
    carries the rank's arguments (a torchrun agent) is no fork: it and its rank both stay."""
    import signal
    import subprocess

    run = str(tmp_path / "run")
    rank = "import os, time\nif os.fork():\n    print('rank', os.getpid(), flush=True)\ntime.sleep(30)"  # and a worker
    agent = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', *sys.argv[1:]]); time.sleep(30)"
    started = [
        subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
        for command in (
            [sys.executable, "-c", rank, "--run-dir", run],
            [sys.executable, "-c", rank, "--run-dir", run],
            [sys.executable, "-c", agent, rank, "--run-dir", run],
        )
    ]
    try:
        rank_pids = [int(process.stdout.readline().split()[1]) for process in started]
        assert rank_pids[:2] == [started[0].pid, started[1].pid]
        workers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and f" {rank_pids[0]} " in _stat(p)]
        assert workers, "the rank forked no worker"
        assert sorted(pid for pid, _ in hang._ranks(run)) == sorted([*rank_pids, started[2].pid])
    finally:
        for process in started:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _stat(entry: Path) -> str:
    try:
        return (entry / "stat").read_text().rsplit(")", 1)[1]
    except (OSError, IndexError):
        return ""


def test_the_trainer_accepts_a_new_batch_split_on_resume_only_with_keep_global_batch():
    parser = train_config.build_parser("x")
    saved = train_config.config_from_args(parser.parse_args(["--recipe", "transformer-tiny"])).to_dict()
    args = ["--recipe", "transformer-tiny", "--batch-per-gpu", "32", "--grad-accum", "2"]
    with pytest.raises(train_config.ConfigError, match="--batch-per-gpu 32 differs"):
        train_config.resume_config(saved, parser.parse_args(args))
    config, changes = train_config.resume_config(saved, parser.parse_args(args + ["--keep-global-batch", "128"]))
    assert (config.batch_per_gpu, config.grad_accum) == (32, 2) and len(changes) == 2


def test_negative_restarts_and_min_nodes_are_refused():
    with pytest.raises(launch.LaunchError, match="invalid --max-restarts -1"):
        launch.TrainRequest(max_restarts=-1).validate()
    with pytest.raises(launch.LaunchError, match="invalid --min-nodes 0"):
        launch.TrainRequest(min_nodes=0).validate()


# ---------------------------------------------------------------- the real supervisor

# ssh that answers for every host but $DEAD_HOST (tests/supervisor_standins/ssh-one-dead)
STANDIN_SSH = (STANDINS / "ssh-one-dead").read_text()

FAKE_TRAINER = (STANDINS / "fake_trainer.py").read_text()  # the program each rank runs: argv and exits scripted


def _launcher(run: Path, first_args: list[str], dead: str = "h2", keep_trainer: bool = False, **limits) -> dict:
    if not keep_trainer:
        (run / "fake.py").write_text(FAKE_TRAINER)
    (run / "probe.sh").write_text(f"echo '{HEALTHY}'\n")
    program = [sys.executable, str(run / "fake.py"), str(run), *first_args]
    write_spec(run, program, ["h1", "h2"], **{"max_restarts": 1, **limits})
    supervise(run, STANDIN_SSH, DEAD_HOST=dead)
    return status(run)


def test_the_launcher_restarts_a_died_job_on_the_nodes_still_reachable(tmp_path):
    status = _launcher(tmp_path, [])
    assert status["state"] == "finished", status
    log = (tmp_path / "train.log").read_text()
    # mpirun died and the clean-up's ssh did not reach h2: the cause is h2, not the rank's last words.
    restarted = "restart 1/1 on 1 node(s) h1 from the checkpoint at step 10"
    assert f"launcher: h2 unreachable (mpirun exited with 1); {restarted}" in log
    assert "dropped h2 (unreachable)" in log
    assert "args: -np 1 MASTER_ADDR=h1 --batch-per-gpu 8 --grad-accum 2 --keep-global-batch 16" in log
    assert json.loads((tmp_path / "restarts.json").read_text())[0]["kind"] == "unreachable"


REFUSAL = "error: the checkpoint was trained at a global batch of 24; this launch makes 16"
REFUSING_TRAINER = (STANDINS / "refusing_trainer.py").read_text()  # exits 2 once, saying REFUSAL


@pytest.mark.parametrize("after_a_step", [False, True], ids=["refused", "after-a-step"])
def test_a_trainer_that_refuses_to_start_fails_the_run_with_its_line_and_is_not_restarted(tmp_path, after_a_step):
    """train.py exits 2 for what a relaunch would refuse the same way (a checkpoint of another global batch, a
    bad flag, no data set): relaunching spent --max-restarts and buried its one line under 'died'. Exit 2
    once the attempt has stepped is a failure like any other, restarted."""
    (tmp_path / "refuses.py").write_text(REFUSING_TRAINER)
    (tmp_path / "probe.sh").write_text(f"echo '{HEALTHY}'\n")  # every node healthy at the restart
    args = ["--after-a-step"] if after_a_step else []
    write_spec(
        tmp_path, [sys.executable, str(tmp_path / "refuses.py"), str(tmp_path), *args], ["h1", "h2"], max_restarts=2
    )
    supervise(tmp_path, STANDIN_SSH, DEAD_HOST="none")
    record = status(tmp_path)
    if after_a_step:
        assert record["state"] == "finished" and (tmp_path / "launches").read_text() == "xx", record
        assert json.loads((tmp_path / "restarts.json").read_text())[0]["kind"] == "died"
        return
    assert record["state"] == "failed" and record["exit_code"] == 2, record
    again = "not restarted: a relaunch is refused the same way"
    assert record["reason"] == f"the trainer refused to start ({REFUSAL}); {again}", record
    assert (tmp_path / "launches").read_text() == "x" and not (tmp_path / "restarts.json").exists()


SPOT_TRAINER = (STANDINS / "spot_trainer.py").read_text()  # the program each rank runs: argv and exits scripted


def test_the_launcher_goes_on_without_a_node_whose_spot_notice_ended_the_attempt(tmp_path):
    (tmp_path / "fake.py").write_text(SPOT_TRAINER)
    status = _launcher(tmp_path, [], dead="none", keep_trainer=True)
    assert status["state"] == "finished" and "run ended at step 20: max_steps" in status["reason"], status
    log = (tmp_path / "train.log").read_text()
    restarted = "restart 1/1 on 1 node(s) h1 from the checkpoint at step 12"
    assert f"spot notice: h2: Spot stop at an unknown time; {restarted}" in log, log
    assert json.loads((tmp_path / "restarts.json").read_text())[0]["dropped"] == {"h2": "Spot stop at an unknown time"}


def test_without_restarts_a_spot_notice_ends_the_run_finished_for_a_resume_by_hand(tmp_path):
    (tmp_path / "fake.py").write_text(SPOT_TRAINER)
    status = _launcher(tmp_path, [], dead="none", keep_trainer=True, max_restarts=0)
    assert status["state"] == "finished" and "stop requested" in status["reason"], status
    assert not (tmp_path / "restarts.json").exists()


def test_the_launcher_sees_mpirun_end_at_once_not_at_its_next_poll(tmp_path):
    """A run's end (and `fab train --follow`'s) used to wait for the watchdog's next poll, up to 5 s on
    every run; a 30 s poll here would show it."""
    (tmp_path / "fake.py").write_text(SPOT_TRAINER)
    started = time.monotonic()
    status = _launcher(tmp_path, [], dead="none", keep_trainer=True, max_restarts=0, poll=30)
    assert status["state"] == "finished" and time.monotonic() - started < 15


def test_the_launcher_ends_a_hang_after_the_window_and_names_the_rank(tmp_path):
    status = _launcher(tmp_path, ["--sleep", "50"], hang_floor=2, max_restarts=0, dead="none")
    assert status["state"] == "failed", status
    assert "watchdog: hang: no rank finished a step for" in status["reason"] and "(window 2 s)" in status["reason"]
    assert "rank 0 (pid 1 on n0) is behind: step 10" in status["reason"] and "hang-stacks-1" in status["reason"]
    assert json.loads((tmp_path / "hangs.json").read_text())[0]["rank"] == 0


def test_probe_script_is_what_plan_parses(tmp_path):
    assert health.parse_probe("noise\n" + HEALTHY)["mounted"] is True
