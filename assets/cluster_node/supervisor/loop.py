"""The run's supervisor on the head node: `python -m cluster_node.supervisor.loop RUN_DIR`, started detached by
`fab train` after it wrote RUN_DIR/spec.json. One loop, observe -> decide -> act (the shape of
torchelastic's SimpleElasticAgent._invoke_run), over the states below; mpirun is its child. It logs to
train.log (`launcher:`, `watchdog:` and one short `mpirun:` line per attempt; the whole mpirun line goes
to its own output, launcher.log) and writes run-status.json: `state` is a rundir.RunState for its readers,
`live` carries the State while it runs. Each decision returns an Outcome (torchelastic's RunResult shape):
the next State and, should it be the last, what ended the run and how; the loop applies it.

A Spot notice for the node the supervisor itself runs on (design §3.4): never relaunch from it. The trainer
is already checkpointing (spotwatch wrote `STOP now`); wait for mpirun until the notice's action time less
`limits.spot_margin`, TERM it if needed, then write a final status that says the run is resumable and how,
remove runs/.active and exit, all before EC2 stops the node (the notice gives two minutes:
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Optional

from cluster_node.protocol import phases, rundir
from cluster_node.protocol import spec as specs
from cluster_node.protocol.rundir import EndedBy, EndKind, RunState, ThenStopState
from cluster_node.protocol.spec import RunSpec
from cluster_node.supervisor import goodput, hang, restart_plan
from cluster_node.supervisor.budget import Meter, epoch
from cluster_node.supervisor.nodes import Mpirun, Nodes
from cluster_node.supervisor.observe import Observation, Observer, newest_beat


class State(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"


TERMINAL = (State.FINISHED, State.FAILED)
FORCED_REASON = "stopped by fab stop --force"
DURING_RESTART = "stopped during a restart"


@dataclass(frozen=True)
class Outcome:
    """One decision: the next State and, should it be the last, why (`kind`, `reason`), mpirun's exit code,
    the command that resumes the run (a Spot notice ended it), whether it ended on a stop request at a
    checkpoint (`stopped`: run-status.json says stopped, resumable with `fab train --run NAME`) and whether the
    trainer ended it at a checkpoint of its last step (`at_checkpoint`: the nodes' snapshots hold nothing newer)."""

    state: State
    kind: Optional[EndKind] = None
    reason: str = ""
    code: int = 0
    resume: Optional[str] = None
    stopped: bool = False
    at_checkpoint: bool = False

    def then(self, state: State, **changes: Any) -> Outcome:
        return dataclasses.replace(self, state=state, **changes)

    @property
    def run_state(self) -> RunState:
        """run-status.json's `state` once the loop ended."""
        if self.state == State.FINISHED:
            return RunState.STOPPED if self.stopped else RunState.FINISHED
        return RunState.FAILED if self.state == State.FAILED else RunState.RUNNING


_ERROR = re.compile(r"mpirun noticed|exited on signal|Error|error:")
_REFUSAL = re.compile(r"^error: ")  # how the trainer says what it refuses (train.py), on one line
# The trainer's exit status for settings, a checkpoint or data it refuses (train.py; argparse's too): mpirun
# exits with its ranks' first non-zero status (Open MPI), and a relaunch would be refused the same way.
REFUSED_EXIT = 2
_ENDED = re.compile(r"run ended at step.*")  # the trainer's last line (from the match on)


def now_iso(now: Optional[float] = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))


class Supervisor:
    """`launcher` starts, waits for and ends mpirun (nodes.Mpirun); `nodes` acts on the nodes
    (nodes.Nodes); `observer(run, spec, ssh_ok, clock)` makes each attempt's observer. Tests pass fakes."""

    def __init__(
        self, run: Path, spec: RunSpec, launcher, nodes, clock: Callable[[], float] = time.time, observer=Observer
    ):
        self.run, self.spec, self.launcher, self.nodes, self.clock = run, spec, launcher, nodes, clock
        self.make_observer = observer
        self.outcome = Outcome(State.STARTING)
        self.unreached: set[str] = set()
        self.observer: Optional[Any] = None
        self.attempts = 0
        self.log_offset = 0
        self.started = clock()  # this segment of the run (a resume starts another)
        self.meter = Meter.of(spec, clock())  # --budget-usd; its `stopped` line once reached

    # The latest outcome's parts, as the records and the tests read them.
    @property
    def state(self) -> State:
        return self.outcome.state

    @property
    def kind(self) -> Optional[EndKind]:
        return self.outcome.kind

    @property
    def reason(self) -> str:
        return self.outcome.reason

    @property
    def code(self) -> int:
        return self.outcome.code

    # ------------------------------------------------------------ records

    def log(self, line: str) -> None:
        with open(self.run / rundir.TRAIN_LOG, "a") as handle:
            handle.write(f"{now_iso(self.clock())} {line}\n")

    def status(
        self, state: RunState, code: Optional[int], reason: str, then_stop: Optional[ThenStopState] = None
    ) -> None:
        running = state == RunState.RUNNING
        record = rundir.RunStatus(
            state=state,
            exit_code=code,
            reason=reason,
            time=now_iso(self.clock()),
            head=socket.gethostname(),
            live=self.state.value if running else None,
            kind=self.kind if not running else None,
            resume=self.outcome.resume,
            then_stop=then_stop,
        )
        rundir.write_record(self.run / rundir.RUN_STATUS, record)

    # ------------------------------------------------------------ the loop

    def run_all(self) -> int:
        (self.run / rundir.LAUNCHER_PID).write_text(f"{os.getpid()}\n")
        self.status(RunState.RUNNING, None, "")
        phases.mark(self.run, "run", self.clock())
        for old in self.run.glob(rundir.HANG_STACKS.format(n="*")):
            shutil.rmtree(old, ignore_errors=True)
        self.launch()
        while self.state not in TERMINAL:
            self.step()
        self.finish()
        return self.code

    def step(self) -> State:
        """One turn of the loop: observe (STARTING, RUNNING), decide, apply the outcome; its State."""
        if self.state == State.RESTARTING:
            return self.apply(self.restarting())
        if self.state == State.STOPPING:
            return self.apply(self.stopping())
        exited = self.launcher.wait(self.spec.limits.poll)
        assert self.observer is not None
        outcome = self.decide(self.observer.observe(exited))
        if outcome.state in (State.STOPPING, State.RESTARTING) or (outcome.state == State.FAILED and outcome.kind):
            step, beat = phases.last_beat(self.run)
            phases.mark(self.run, "detect", self.clock(), kind=outcome.kind, step=step, end=beat)
        return self.apply(outcome)

    def apply(self, outcome: Outcome) -> State:
        self.outcome = outcome
        return outcome.state

    def launch(self) -> None:
        self.attempts += 1
        self.log(self.spec.summary())
        self.log_offset = (self.run / rundir.TRAIN_LOG).stat().st_size  # this attempt's part of train.log starts here
        # The whole line goes to launcher.log (this process's output) and stays rebuildable from specs/.
        print(f"{now_iso(self.clock())} attempt {self.spec.attempt}: {shlex.join(self.spec.argv())}", flush=True)
        for name in (rundir.RANKS, rundir.STACKS):
            shutil.rmtree(self.run / name, ignore_errors=True)
            (self.run / name).mkdir(exist_ok=True)  # a cut-off rank may still write there
        self.observer = self.make_observer(self.run, self.spec, self.nodes.ssh_ok, self.clock)
        phases.mark(self.run, "launch", self.clock())
        self.launcher.start(self.spec)

    def decide(self, obs: Observation) -> Outcome:
        """STARTING/RUNNING: rows 2-10 and 16 of the design's table."""
        if obs.own_notice is not None:
            return self.own_spot(obs.own_notice, obs.exited)
        if obs.exited is not None:
            return self.ended(obs.exited)
        if self.meter:
            self.meter.check(self.run, self.clock(), self.log)
        watchdog = self._watchdog(obs)
        if watchdog:
            reason, kind = watchdog
            return self.outcome.then(State.STOPPING, reason=reason, kind=kind)
        return self.outcome.then(State.RUNNING) if obs.first_step else self.outcome

    def _watchdog(self, obs: Observation) -> Optional[tuple[str, EndKind]]:
        limits = self.spec.limits
        if obs.unreachable:
            silent = int(limits.unreachable * limits.poll)
            why = f"{self.spec.name(obs.unreachable)} unreachable (no ssh answer for {silent}+ s)"
            return why, EndKind.UNREACHABLE
        if obs.hang:
            self.nodes.collect_stacks(self.spec.hosts)
            evidence = hang.record(self.run, self.clock())
            stacks = self.run / rundir.HANG_STACKS.format(n=self.attempts)
            (self.run / rundir.STACKS).rename(stacks)  # the next attempt starts a fresh stacks/
            age, window = obs.hang
            why = f"hang: no rank finished a step for {age} s (window {window} s); {evidence}; stacks in {stacks}"
            return why, EndKind.HANG
        if obs.stall is not None:
            return f"no training progress for {obs.stall} s", EndKind.HANG
        if obs.start_timeout:
            start = int(limits.start)
            stuck = f"mpirun or the data load is stuck: see {rundir.TRAIN_LOG}"
            why = f"no training step within {start} s of the start ({stuck})"
            return why, EndKind.START
        return None

    def ended(self, code: int) -> Outcome:
        """mpirun ended by itself: rows 7-10."""
        self.log(f"launcher: mpirun exited with {code}")
        if code != 0:
            self.cleanup_all()
        if (self.run / rundir.FORCED).exists():
            return Outcome(State.FAILED, EndKind.FORCED, FORCED_REASON, code)
        if code == 0:
            return self.clean_end()
        lost = [h for h in self.spec.hosts if h in self.unreached]  # the clean-up's ssh did not get through
        if lost:
            why, kind = f"{self.spec.names_of(lost)} unreachable (mpirun exited with {code})", EndKind.UNREACHABLE
        elif code == REFUSED_EXIT and not self.stepped():  # refused before its first step: no restart
            return Outcome(State.FAILED, EndKind.DIED, self.refusal(code), code)
        else:
            why, kind = _last(self.run, _ERROR), EndKind.DIED
        return Outcome(self.after_failure(), kind, why, code)

    def stepped(self) -> bool:
        """Whether this attempt finished a step: seen by a poll, or a heartbeat since its launch (mpirun can end
        within one poll of a step)."""
        assert self.observer is not None
        beat = newest_beat(self.run)
        return self.state != State.STARTING or 0 < beat and beat >= self.observer.started

    def refusal(self, code: int) -> str:
        """The trainer's own `error:` line from this attempt's part of train.log (not an earlier attempt's)."""
        said = _last(self.run, _REFUSAL, since=self.log_offset) or f"mpirun exited with {code}"
        again = "; not restarted: a relaunch is refused the same way" if self.spec.limits.max_restarts > 0 else ""
        return f"the trainer refused to start ({said}){again}"

    def clean_end(self) -> Outcome:
        """Rows 8, 9: mpirun exited 0. The trainer's end record says what ended it (a stop: resumable)."""
        assert self.observer is not None
        spot = restart_plan.spot_ended(self.run, self.spec.hosts, self.observer.started)
        if spot and self.spec.limits.max_restarts > 0:
            return Outcome(State.RESTARTING, EndKind.SPOT, spot)
        resume = shlex.join(self.spec.resume) if spot and self.spec.resume else None
        end = trainer_end(self.run)
        # Its words as it logged them; a program with no end record (fab check's, a stand-in): its log line.
        reason = f"run ended at step {end.step}: {end.ended}" if end is not None else _last(self.run, _ENDED)
        stopped = end is not None and end.end == EndedBy.STOP
        if self.meter and self.meter.stopped:
            step = restart_plan.last_checkpoint_step(self.run)
            reason = f"{self.meter.stopped}; checkpoint step {step}"
            return Outcome(State.FINISHED, EndKind.BUDGET, reason, resume=resume, stopped=stopped, at_checkpoint=True)
        return Outcome(State.FINISHED, None, reason, resume=resume, stopped=stopped, at_checkpoint=True)

    def after_failure(self) -> State:
        return State.RESTARTING if self.spec.limits.max_restarts > 0 else State.FAILED

    def stopping(self) -> Outcome:
        """Row 11: end the attempt the watchdog gave up on."""
        self.log(f"watchdog: {self.reason}; ending the attempt")
        code = self.launcher.end()
        self.log(f"launcher: mpirun exited with {code}")
        self.cleanup_all()
        return self.outcome.then(self.after_failure(), reason=f"watchdog: {self.reason}", code=code)

    def interrupted(self) -> Optional[Outcome]:
        """Rows 12, 13, 16 during a restart: a hard stop, a graceful stop, a notice for this node."""
        if (self.run / rundir.FORCED).exists():
            return self.outcome.then(State.FAILED, kind=EndKind.FORCED, reason=FORCED_REASON)
        if self.meter:  # the spend goes on while the nodes are probed
            self.meter.check(self.run, self.clock(), self.log)
        assert self.observer is not None
        notice = self.observer.own_notice()  # first: the head's own notice comes with a STOP too
        if notice is not None:
            return self.own_spot(notice, self.code)
        if (self.run / rundir.STOP).exists() and not self.took_a_workers_notice():
            return self.stopped_during_restart()
        return None

    def took_a_workers_notice(self) -> bool:
        """A STOP only workers' Spot watchers wrote while the nodes are probed (each line a notice they recorded
        first, none this node's): no reason to end the run; the plan leaves those nodes out, and the STOP must not
        reach the next attempt's trainer. Any other line (fab stop's, the budget's, an empty STOP) ends it."""
        assert self.observer is not None
        if self.meter and self.meter.stopped:
            return False
        stop, taken = self.run / rundir.STOP, self.run / rundir.STOP_TAKEN
        try:  # taken aside in one step: a line appended meanwhile goes to a new STOP, not lost with this one
            os.replace(stop, taken)
            lines = taken.read_text().splitlines()
        except OSError:
            _put_back(taken, stop, None)
            return False
        # Read after the rename: each watcher records its notice before it appends its line, so every line taken
        # that is a worker's has its record by now.
        noticed = restart_plan.notices(self.run, self.observer.started)
        workers = [f"{rundir.URGENT_STOP_WORD}: spot: node{e.node} " for e in noticed.values()]
        others = [line for line in lines if not any(line.startswith(worker) for worker in workers)]
        if others or not lines or self.spec.supervisor_host in noticed:  # fab stop's, the budget's, an empty one
            _put_back(taken, stop, lines)
            return False
        taken.unlink(missing_ok=True)
        self.log(f"launcher: a Spot notice during the restart ({lines[0]}): the next attempt leaves that node out")
        return True

    def noticed_in(self, plan: restart_plan.Plan) -> bool:
        """Whether a node of the planned attempt has a Spot notice (one that landed after the plan was made)."""
        assert self.observer is not None
        noticed = restart_plan.notices(self.run, self.observer.started)
        return plan.spec is not None and any(host in noticed for host in plan.spec.hosts)

    def stopped_during_restart(self) -> Outcome:
        """Row 13: a STOP while restarting ends the run at its last checkpoint, resumable; the budget's line
        and kind when the meter wrote the STOP, the restart's kind otherwise."""
        stopped = f"{DURING_RESTART} at checkpoint {restart_plan.last_checkpoint_step(self.run)} ({self.reason})"
        if self.meter and self.meter.stopped:
            return self.outcome.then(
                State.FINISHED, reason=f"{self.meter.stopped}; {stopped}", kind=EndKind.BUDGET, stopped=True
            )
        return self.outcome.then(State.FINISHED, reason=stopped, stopped=True)

    def restarting(self) -> Outcome:
        """Rows 12-15: probe the pool, plan; a new spec and a new attempt, or the end."""
        stopped = self.interrupted()
        if stopped is not None:
            return stopped
        self.nodes.probe_all()
        stopped = self.interrupted()
        if stopped is not None:
            return stopped
        assert self.observer is not None and self.kind is not None
        plan = self.planned()
        while True:
            stopped = self.interrupted()  # a snapshot's copy can take minutes: a stop meanwhile wins
            if stopped is not None:
                return stopped
            if not self.noticed_in(plan):
                break
            plan = self.planned()  # a worker's notice landed while planning: again, without it (one node fewer)
        if plan.spec is None or plan.record is None:
            return self.outcome.then(State.FAILED, reason=f"{self.reason}; {plan.line}")
        self.log(f"launcher: {self.reason}; {plan.line}")
        rundir.append(self.run / rundir.RESTARTS, plan.record)
        phases.mark(self.run, "decide", self.clock(), step=plan.record.resume_step, kind=self.kind)
        self.spec = plan.spec
        specs.write(self.run, self.spec)
        self.launch()
        return self.outcome.then(State.STARTING)

    def planned(self) -> restart_plan.Plan:
        """The restart's plan; a snapshot that not every node of the next attempt holds is copied to /data by
        its holder first, and when that copy fails the plan falls back to the newest checkpoint."""
        assert self.observer is not None and self.kind is not None
        plan = restart_plan.plan(self.run, self.spec, self.kind, self.reason, since=self.observer.started)
        point = plan.point
        if point is None or point.holder is None or point.step is None or not point.copy:
            return plan
        name, step = self.spec.name(point.holder), point.step
        copied = self.nodes.persist_snapshot(point.holder, step, point.bytes)
        if copied is not None:
            self.log(f"launcher: {name}'s snapshot at step {step} copied to {copied}")
            return plan
        self.log(f"launcher: copying {name}'s snapshot at step {step} to /data failed; the next newest state")
        return restart_plan.plan(self.run, self.spec, self.kind, self.reason, self.observer.started, copy=False)

    def own_spot(self, notice: rundir.Interruption, exited: Optional[int]) -> Outcome:
        """Row 16: the supervisor's own node will go. Let the checkpoint land, end, say how to resume."""
        deadline = (epoch(notice.action_time) or self.clock() + 120) - self.spec.limits.spot_margin
        if exited is None:
            exited = self.launcher.wait(deadline - self.clock())
        if exited is None:
            self.log("launcher: the checkpoint did not end the attempt in time; ending mpirun")
            exited = self.launcher.end()
        step = restart_plan.last_checkpoint_step(self.run)
        where = f"node{notice.node} ({notice.host})" if notice.node is not None else str(notice.host)
        resume = self.resume_command(notice)
        # fab reaches the cluster through node0: it must be back (EC2 restarts a stopped persistent Spot
        # node when capacity returns, with a new public address) before the resume can run.
        # --then-stop (a budget implies it) stops every node with StopInstances: EC2 restarts no instance a user
        # stopped, only one it interrupted itself.
        started = "`fab start`, then" if self.spec.then_stop is not None else "once EC2 starts it again:"
        first = (
            f"{started} `fab inventory`, then"
            if notice.action != "terminate"
            else ("node0 is fab's way in: replace it (`cdk deploy`), `fab inventory`, then")
        )
        reason = (
            f"spot: {where} will {notice.action or 'stop'} at {notice.action_time or 'an unknown time'}; "
            f"checkpoint step {step}; resumable, {first} {resume}"
        )
        self.log(f"launcher: {reason}")
        if self.spec.limits.max_restarts > 0:
            return Outcome(State.FAILED, EndKind.SPOT, reason, exited, resume)
        stopped = (end := trainer_end(self.run)) is not None and end.end == EndedBy.STOP
        return Outcome(State.FINISHED, EndKind.SPOT, reason, exited, resume, stopped)

    def resume_command(self, notice: rundir.Interruption) -> str:
        """`fab train --run NAME ...` as fab train wrote it; after a terminate notice without this node and
        with the global batch kept over the others."""
        command = list(self.spec.resume) or ["fab", "train", "--run", self.run.name]
        others = [h for h in self.spec.hosts if h != notice.host]
        config = rundir.read_json(self.run / rundir.CONFIG, {}) or {}
        if notice.action != "terminate" or not others or not config:
            return shlex.join(command)
        global_batch = specs.trained_global_batch(config, self.spec) or 0
        fixed = specs.sized_by_tokens(config)
        split = restart_plan.rebalance(global_batch, len(others) * self.spec.slots, config["batch_per_gpu"], fixed)
        command += ["--exclude", str(notice.node)]
        if split:
            batch = f"--batch-per-gpu {split[0]} --grad-accum {split[1]} --keep-global-batch {global_batch}"
            command += ["--extra", batch]
        return shlex.join(command)

    # ------------------------------------------------------------ the end (row 17)

    def cleanup_all(self) -> None:
        """After any failure: no rank or daemon of this attempt survives. A host reached now is no longer unreached
        (a node back from a Spot stop or a partition): an earlier attempt's loss must not name it again."""
        for host in self.spec.hosts:
            if self.nodes.cleanup(host):
                self.unreached.discard(host)
            else:
                self.unreached.add(host)

    def finish(self) -> None:
        """The final status and .active first, then --then-stop: stopping the instances may end this
        process (the container goes with its node), so nothing may be left to write after it."""
        phases.mark(self.run, "done", self.clock(), kind=self.kind)
        if self.meter:  # the spend up to the end
            self.meter.save(self.run, self.clock(), self.log)
        goodput.record(self.run)  # the account into summary.json, before anything may stop this node
        state, reason = self.outcome.run_state, self.reason
        if self.spec.then_stop is not None:  # then_stop: stopping, then sent or failed (a follower waits for it)
            reason = f"{reason}; then-stop: stopping the cluster".lstrip("; ")
        self.status(state, self.code, reason, ThenStopState.STOPPING if self.spec.then_stop else None)
        rundir.append(self.run / rundir.SEGMENTS, rundir.Segment(started=self.started, ended=self.clock(), state=state))
        if self.outcome.at_checkpoint and self.spec.then_stop is None:  # (a stop frees the nodes' RAM)
            # Before the head is free: a new `fab train --run NAME` must not lose its own snapshots to this.
            self.nodes.drop_snapshots(self.spec.pool)
        active = _free_head(self.run, Path(self.spec.active_file))
        if self.spec.then_stop is not None:
            stopped = self.nodes.then_stop(self.run / rundir.TRAIN_LOG)
            if not stopped:
                self.log("launcher: --then-stop failed")
                reason += " failed: the cluster keeps running"
            self.status(state, self.code, reason, ThenStopState.SENT if stopped else ThenStopState.FAILED)
        self.retry_cleanup(active)

    def crashed(self, error: Exception) -> None:
        """Its own failure: end mpirun, a failed status, free the head, --then-stop last (main() re-raises)."""
        with contextlib.suppress(Exception):
            self.launcher.end()
        line = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        stop = "; then-stop: stopping the cluster" if self.spec.then_stop is not None else ""
        reason = f"supervisor crashed ({line}); see {rundir.LAUNCHER_LOG}{stop}"
        with contextlib.suppress(Exception):  # /data may be what failed: the stop below must still run
            # a follower waits for the outcome
            self.status(RunState.FAILED, None, reason, ThenStopState.STOPPING if stop else None)
        _free_head(self.run, Path(self.spec.active_file))
        if self.spec.then_stop is not None:  # last (it may end this process): "however it ends" includes a bug
            stopped = False
            with contextlib.suppress(Exception):
                stopped = self.nodes.then_stop(self.run / rundir.TRAIN_LOG)
                self.status(RunState.FAILED, None, reason, ThenStopState.SENT if stopped else ThenStopState.FAILED)

    def retry_cleanup(self, active: Path, pause: float = 5.0) -> None:
        """A partitioned node keeps its MPI daemon until reached: retry a while, unless a new run started."""
        deadline = self.clock() + self.spec.limits.cleanup
        while self.unreached and self.clock() < deadline and not _nonempty(active):
            time.sleep(pause)
            for host in sorted(self.unreached):
                if _nonempty(active):  # a run started during the pause: its daemons are not ours to kill
                    return
                if self.nodes.cleanup(host):
                    self.log(f"launcher: cleaned up {host} after it came back")
                    self.unreached.discard(host)


def _put_back(taken: Path, stop: Path, lines: Optional[list[str]]) -> None:
    """A STOP taken aside that ends the run after all goes back, after any line appended meanwhile (`lines`:
    what was read; None: unread, the file itself goes back)."""
    try:
        text = taken.read_text() if lines is None else "\n".join(lines or [""]) + "\n"
        with open(stop, "a") as again:
            again.write(text or "\n")
        taken.unlink(missing_ok=True)
    except OSError:
        pass  # nothing was taken (no STOP), or /data refuses: the caller ends the run all the same


def trainer_end(run: Path) -> Optional[rundir.Progress]:
    """The trainer's end record (progress.json once it says what ended the run); None without one."""
    progress = rundir.read_record(run / rundir.PROGRESS, rundir.Progress)
    return progress if progress is not None and progress.end is not None else None


def _free_head(run: Path, active: Path) -> Path:
    """.active names the head's current run: free it for the next `fab train` if it is still ours."""
    with contextlib.suppress(OSError):
        if active.read_text().strip() == str(run):
            active.unlink()
    return active


def _nonempty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _last(run: Path, pattern: re.Pattern, since: int = 0) -> str:
    """The last line of train.log (from byte `since` on) that matches `pattern` (_ENDED: from the match on)."""
    try:
        with open(run / rundir.TRAIN_LOG, errors="replace") as handle:
            handle.seek(since)
            lines = handle.read().splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        match = pattern.search(line)
        if match:
            return line[match.start() :] if pattern is _ENDED else line
    return ""


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m cluster_node.supervisor.loop RUN_DIR", file=sys.stderr)
        return 2
    run = Path(argv[0])
    spec = specs.read(run)
    supervisor = Supervisor(run, spec, Mpirun(run), Nodes(run, spec))
    try:
        return supervisor.run_all()
    except Exception as error:  # a bug must not leave the run "running" for ever, nor mpirun orphaned
        supervisor.crashed(error)
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
