"""The run's supervisor on the head node: `python -m cluster_node.supervisor.loop RUN_DIR`, started detached by
`fab train` after it wrote RUN_DIR/spec.json. One loop, observe -> decide -> act (the shape of
torchelastic's SimpleElasticAgent._invoke_run), over the states below; mpirun is its child. It logs to
train.log (`launcher:`, `watchdog:` and one short `mpirun:` line per attempt; the whole mpirun line goes
to its own output, launcher.log) and writes run-status.json: `state` stays running/finished/
failed for its readers, `live` carries the State while it runs.

A Spot notice for the node the supervisor itself runs on (design §3.4): never relaunch from it. The trainer
is already checkpointing (spotwatch wrote `STOP now`); wait for mpirun until the notice's action time less
`limits.spot_margin`, TERM it if needed, then write a final status that says the run is resumable and how,
remove runs/.active and exit, all before EC2 stops the node (the notice gives two minutes:
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html)."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Optional

from cluster_node.protocol import phases, rundir
from cluster_node.protocol import spec as specs
from cluster_node.protocol.spec import RunSpec
from cluster_node.supervisor import goodput, hang, restart_plan
from cluster_node.supervisor.budget import DURING_RESTART, Meter, during_restart, epoch
from cluster_node.supervisor.nodes import Mpirun, Nodes
from cluster_node.supervisor.observe import Observation, Observer


class State(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"


TERMINAL = (State.FINISHED, State.FAILED)
FORCED_REASON = "stopped by fab stop --force"
_ERROR = re.compile(r"mpirun noticed|exited on signal|Error|error:")


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
        self.state = State.STARTING
        self.code, self.reason, self.kind = 0, "", ""
        self.resume: Optional[str] = None
        self.unreached: set[str] = set()
        self.observer: Optional[Any] = None
        self.attempts = 0
        self.started = clock()  # this segment of the run (a resume starts another)
        self.meter = Meter.of(spec, clock())  # --budget-usd; its `stopped` line once reached

    # ------------------------------------------------------------ records

    def log(self, line: str) -> None:
        with open(self.run / rundir.TRAIN_LOG, "a") as handle:
            handle.write(f"{now_iso(self.clock())} {line}\n")

    def status(self, state: str, code: Optional[int], reason: str, then_stop: Optional[str] = None) -> None:
        record = rundir.RunStatus(
            state=state,
            exit_code=code,
            reason=reason,
            time=now_iso(self.clock()),
            head=socket.gethostname(),
            live=self.state.value if state == "running" else None,
            kind=self.kind or None if state != "running" else None,
            resume=self.resume,
            then_stop=then_stop,
        )
        rundir.write_record(self.run / rundir.RUN_STATUS, record)

    # ------------------------------------------------------------ the loop

    def run_all(self) -> int:
        (self.run / rundir.LAUNCHER_PID).write_text(f"{os.getpid()}\n")
        self.status("running", None, "")
        phases.mark(self.run, "run", self.clock())
        for old in self.run.glob(rundir.HANG_STACKS.format(n="*")):
            shutil.rmtree(old, ignore_errors=True)
        self.launch()
        while self.state not in TERMINAL:
            self.state = self.step()
        self.finish()
        return self.code

    def step(self) -> State:
        if self.state == State.RESTARTING:
            return self.restarting()
        if self.state == State.STOPPING:
            return self.stopping()
        exited = self.launcher.wait(self.spec.limits.poll)
        assert self.observer is not None
        state = self.decide(self.observer.observe(exited))
        if state in (State.STOPPING, State.RESTARTING) or (state == State.FAILED and self.kind):
            step, beat = phases.last_beat(self.run)
            phases.mark(self.run, "detect", self.clock(), kind=self.kind or None, step=step, end=beat)
        return state

    def launch(self) -> None:
        self.attempts += 1
        self.log(self.spec.summary())
        # The whole line goes to launcher.log (this process's output) and stays rebuildable from specs/.
        print(f"{now_iso(self.clock())} attempt {self.spec.attempt}: {shlex.join(self.spec.argv())}", flush=True)
        for name in (rundir.RANKS, rundir.STACKS):
            shutil.rmtree(self.run / name, ignore_errors=True)
            (self.run / name).mkdir(exist_ok=True)  # a cut-off rank may still write there
        self.observer = self.make_observer(self.run, self.spec, self.nodes.ssh_ok, self.clock)
        phases.mark(self.run, "launch", self.clock())
        self.launcher.start(self.spec)
        self.state = State.STARTING

    def decide(self, obs: Observation) -> State:
        """STARTING/RUNNING: rows 2-10 and 16 of the design's table."""
        if obs.own_notice is not None:
            return self.own_spot(obs.own_notice, obs.exited)
        if obs.exited is not None:
            return self.ended(obs.exited)
        if self.meter:
            self.meter.check(self.run, self.clock(), self.log)
        watchdog = self._watchdog(obs)
        if watchdog:
            self.reason, self.kind = watchdog
            return State.STOPPING
        return State.RUNNING if obs.first_step else self.state

    def _watchdog(self, obs: Observation) -> Optional[tuple[str, str]]:
        limits = self.spec.limits
        if obs.unreachable:
            silent = int(limits.unreachable * limits.poll)
            return f"{self.spec.name(obs.unreachable)} unreachable (no ssh answer for {silent}+ s)", "unreachable"
        if obs.hang:
            self.nodes.collect_stacks(self.spec.hosts)
            evidence = hang.record(self.run, self.clock())
            stacks = self.run / rundir.HANG_STACKS.format(n=self.attempts)
            (self.run / rundir.STACKS).rename(stacks)  # the next attempt starts a fresh stacks/
            age, window = obs.hang
            why = f"hang: no rank finished a step for {age} s (window {window} s); {evidence}; stacks in {stacks}"
            return why, "hang"
        if obs.stall is not None:
            return f"no training progress for {obs.stall} s", "hang"
        if obs.start_timeout:
            start = int(limits.start)
            stuck = f"mpirun or the data load is stuck: see {rundir.TRAIN_LOG}"
            why = f"no training step within {start} s of the start ({stuck})"
            return why, "start"
        return None

    def ended(self, code: int) -> State:
        """mpirun ended by itself: rows 7-10."""
        self.code = code
        self.log(f"launcher: mpirun exited with {code}")
        if code != 0:
            self.cleanup_all()
        if (self.run / rundir.FORCED).exists():
            self.reason, self.kind = FORCED_REASON, "forced"
            return State.FAILED
        if code == 0:
            assert self.observer is not None
            spot = restart_plan.spot_ended(self.run, self.spec.hosts, self.observer.started)
            if spot and self.spec.limits.max_restarts > 0:
                self.reason, self.kind = spot, "spot"
                return State.RESTARTING
            if spot:
                self.resume = shlex.join(self.spec.resume) if self.spec.resume else None
            self.reason = _last(self.run, re.compile(r"run ended at step.*"))
            if self.meter and self.meter.stopped:
                step = restart_plan.last_checkpoint_step(self.run)
                self.reason, self.kind = f"{self.meter.stopped}; checkpoint step {step}", "budget"
            return State.FINISHED
        lost = [h for h in self.spec.hosts if h in self.unreached]  # the clean-up's ssh did not get through
        if lost:
            self.kind = "unreachable"
            self.reason = f"{self.spec.names_of(lost)} unreachable (mpirun exited with {code})"
        else:
            self.reason, self.kind = _last(self.run, _ERROR), "died"
        return State.RESTARTING if self.spec.limits.max_restarts > 0 else State.FAILED

    def stopping(self) -> State:
        """Row 11: end the attempt the watchdog gave up on."""
        self.log(f"watchdog: {self.reason}; ending the attempt")
        self.code = self.launcher.end()
        self.log(f"launcher: mpirun exited with {self.code}")
        self.cleanup_all()
        self.reason = f"watchdog: {self.reason}"
        return State.RESTARTING if self.spec.limits.max_restarts > 0 else State.FAILED

    def interrupted(self) -> Optional[State]:
        """Rows 12, 13, 16 during a restart: a hard stop, a graceful stop, a notice for this node."""
        if (self.run / rundir.FORCED).exists():
            self.reason, self.kind = FORCED_REASON, "forced"
            return State.FAILED
        if self.meter:  # the spend goes on while the nodes are probed
            self.meter.check(self.run, self.clock(), self.log)
        if (self.run / rundir.STOP).exists():
            step = restart_plan.last_checkpoint_step(self.run)
            self.reason, self.kind = during_restart(self.meter, step, self.reason, self.kind)
            return State.FINISHED
        assert self.observer is not None
        notice = self.observer.own_notice()
        return self.own_spot(notice, self.code) if notice is not None else None

    def restarting(self) -> State:
        """Rows 12-15: probe the pool, plan; a new spec and a new attempt, or the end."""
        stopped = self.interrupted()
        if stopped is not None:
            return stopped
        self.nodes.probe_all()
        stopped = self.interrupted()
        if stopped is not None:
            return stopped
        assert self.observer is not None
        plan = restart_plan.plan(self.run, self.spec, self.kind, self.reason, since=self.observer.started)
        if plan.spec is None or plan.record is None:
            self.reason += f"; {plan.line}"
            return State.FAILED
        self.log(f"launcher: {self.reason}; {plan.line}")
        rundir.append(self.run / rundir.RESTARTS, plan.record)
        phases.mark(self.run, "decide", self.clock(), step=plan.record.resume_step, kind=self.kind or None)
        self.spec = plan.spec
        specs.write(self.run, self.spec)
        self.launch()
        return State.STARTING

    def own_spot(self, notice: rundir.Interruption, exited: Optional[int]) -> State:
        """Row 16: the supervisor's own node will go. Let the checkpoint land, end, say how to resume."""
        deadline = (epoch(notice.action_time) or self.clock() + 120) - self.spec.limits.spot_margin
        if exited is None:
            exited = self.launcher.wait(deadline - self.clock())
        if exited is None:
            self.log("launcher: the checkpoint did not end the attempt in time; ending mpirun")
            exited = self.launcher.end()
        self.code = exited
        step = restart_plan.last_checkpoint_step(self.run)
        where = f"node{notice.node} ({notice.host})" if notice.node is not None else str(notice.host)
        self.kind, self.resume = "spot", self.resume_command(notice)
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
        self.reason = (
            f"spot: {where} will {notice.action or 'stop'} at {notice.action_time or 'an unknown time'}; "
            f"checkpoint step {step}; resumable, {first} {self.resume}"
        )
        self.log(f"launcher: {self.reason}")
        return State.FAILED if self.spec.limits.max_restarts > 0 else State.FINISHED

    def resume_command(self, notice: rundir.Interruption) -> str:
        """`fab train --run NAME ...` as fab train wrote it; after a terminate notice without this node and
        with the global batch kept over the others."""
        command = list(self.spec.resume) or ["fab", "train", "--run", self.run.name]
        others = [h for h in self.spec.hosts if h != notice.host]
        config = rundir.read_json(self.run / rundir.CONFIG, {}) or {}
        if notice.action != "terminate" or not others or not config:
            return shlex.join(command)
        global_batch = config["batch_per_gpu"] * config["grad_accum"] * len(self.spec.hosts) * self.spec.slots
        split = restart_plan.rebalance(global_batch, len(others) * self.spec.slots, config["batch_per_gpu"])
        command += ["--exclude", str(notice.node)]
        if split:
            batch = f"--batch-per-gpu {split[0]} --grad-accum {split[1]} --keep-global-batch {global_batch}"
            command += ["--extra", batch]
        return shlex.join(command)

    # ------------------------------------------------------------ the end (row 17)

    def cleanup_all(self) -> None:
        """After any failure: no rank or daemon of this attempt survives."""
        for host in self.spec.hosts:
            if not self.nodes.cleanup(host):
                self.unreached.add(host)

    def finish(self) -> None:
        """The final status and .active first, then --then-stop: stopping the instances may end this
        process (the container goes with its node), so nothing may be left to write after it."""
        phases.mark(self.run, "done", self.clock(), kind=self.kind or None)
        if self.meter:  # the spend up to the end
            self.meter.save(self.run, self.clock(), self.log)
        goodput.record(self.run)  # the account into summary.json, before anything may stop this node
        state = final_state(self.run, self.state, self.reason)
        if self.spec.then_stop is not None:  # then_stop: stopping, then sent or failed (a follower waits for it)
            self.reason = f"{self.reason}; then-stop: stopping the cluster".lstrip("; ")
        self.status(state, self.code, self.reason, "stopping" if self.spec.then_stop else None)
        rundir.append(self.run / rundir.SEGMENTS, rundir.Segment(started=self.started, ended=self.clock(), state=state))
        active = _free_head(self.run, Path(self.spec.active_file))
        if self.spec.then_stop is not None:
            stopped = self.nodes.then_stop(self.run / rundir.TRAIN_LOG)
            if not stopped:
                self.log("launcher: --then-stop failed")
                self.reason += " failed: the cluster keeps running"
            self.status(state, self.code, self.reason, "sent" if stopped else "failed")
        self.retry_cleanup(active)

    def crashed(self, error: Exception) -> None:
        """Its own failure: end mpirun, a failed status, free the head, --then-stop last (main() re-raises)."""
        with contextlib.suppress(Exception):
            self.launcher.end()
        line = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        stop = "; then-stop: stopping the cluster" if self.spec.then_stop is not None else ""
        reason = f"supervisor crashed ({line}); see {rundir.LAUNCHER_LOG}{stop}"
        with contextlib.suppress(Exception):  # /data may be what failed: the stop below must still run
            self.status("failed", None, reason, "stopping" if stop else None)  # a follower waits for the outcome
        _free_head(self.run, Path(self.spec.active_file))
        if self.spec.then_stop is not None:  # last (it may end this process): "however it ends" includes a bug
            stopped = False
            with contextlib.suppress(Exception):
                stopped = self.nodes.then_stop(self.run / rundir.TRAIN_LOG)
                self.status("failed", None, reason, "sent" if stopped else "failed")

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


def final_state(run: Path, state: State, reason: str) -> str:
    """run-status.json's `state`: `stopped` (resumable with `fab train --run NAME`) for a run that ended on a
    stop request (fab stop, a Spot notice: the trainer's end record says so) or was stopped during a restart."""
    ended = (rundir.read_record(run / rundir.PROGRESS, rundir.Progress) or rundir.Progress(step=0)).ended or ""
    if state == State.FINISHED and (ended.startswith("stop requested") or DURING_RESTART in reason):
        return "stopped"
    return state.value


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


def _last(run: Path, pattern: re.Pattern) -> str:
    """The last match of `pattern` in train.log (the whole rest of the line)."""
    try:
        lines = (run / rundir.TRAIN_LOG).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        match = pattern.search(line)
        if match:
            return line[match.start() :] if pattern.pattern.startswith("run ended") else line
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
