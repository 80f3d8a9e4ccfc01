"""What the trainer reports while it runs, as callbacks the composition root (train.py) hands it: the rank
heartbeat the supervisor's hang watchdog reads, and rank 0's progress.json. File names and records are
cluster_node.protocol.rundir's."""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from cluster_node.protocol import phases, rundir


class Callback:
    """Called by Trainer.fit: on_step after every optimizer step (every rank), on_progress at each log
    step and once at the end with the values progress.json records (every rank; `ended` only at the end)."""

    def on_step(self, step: int) -> None:
        pass

    def on_progress(self, step: int, values: dict[str, Any]) -> None:
        pass

    def on_interval(self, event: str, start: float, end: float, step: int) -> None:
        """An eval, a checkpoint or a snapshot's copy (rank 0 for a checkpoint, every rank for an eval), or
        the batch shapes run before the first step (warm_shapes), took start..end."""

    def flush(self, timeout: float = 10.0) -> bool:
        """What it reported so far made durable (before a node's snapshot); False if that took longer."""
        return True

    def close(self, timeout: float = 2.0) -> None:
        """The process is ending, whatever ends it (train.py's finally)."""


# A rank's heartbeat is written at most this often: EFS meters and caps operations per file system
# (metadata included), and a step of tens of ms on 8 ranks a node would make hundreds a second.
HEARTBEAT_EVERY_S = 0.2
HEARTBEAT_RETRY_S = 0.5
HEARTBEAT_FAILURES = 50  # failed writes in a row (~25 s) before the rank stops: the watchdog would blame it


class RankHeartbeat(Callback):
    """RUN_DIR/ranks/rankN: this rank's last finished step, pid and host; its mtime is that step's time.
    Not atomic (the readers skip a line that does not parse). Written by a thread of its own, the newest
    step at most every HEARTBEAT_EVERY_S: on EFS a write takes at least 2.7 ms (AWS's figure for Standard
    storage; an NFS close flushes it), which on the training thread every step would cost every rank ~5%
    of a 60 ms step. A rank stuck in a collective still has its last step written; flush() makes it
    durable before a node's snapshot (the restart plan trusts a snapshot up to the newest heartbeat)."""

    def __init__(self, run_dir: Path, rank: int, write: Optional[Callable[[Path, str], Any]] = None):
        self.path = rundir.rank_beat(Path(run_dir), rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.pid, self.host = os.getpid(), socket.gethostname()
        self.write = write or (lambda path, text: path.write_text(text))
        self.newest: Optional[int] = None
        self.written: Optional[int] = None
        self.failures, self.error, self.stopped = 0, "", False
        self.waiting = 0  # flush() callers
        self.changed = threading.Condition()
        threading.Thread(target=self._writer, name="rank-heartbeat", daemon=True).start()

    def on_step(self, step: int) -> None:
        if self.failures >= HEARTBEAT_FAILURES:
            raise OSError(f"rank heartbeat not written in {self.failures} tries in a row: {self.error}")
        with self.changed:
            self.newest = step
            self.changed.notify_all()

    def on_progress(self, step: int, values: dict[str, Any]) -> None:
        if values.get("ended"):
            self.flush()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the newest step is written (the writer skips its pause); False if the filesystem
        took longer."""
        with self.changed:
            self.waiting += 1
            self.changed.notify_all()
            try:
                self.changed.wait_for(lambda: self.stopped or self.written == self.newest, timeout)
                return self.written == self.newest
            finally:
                self.waiting -= 1

    def close(self, timeout: float = 2.0) -> None:
        """The process is ending (whatever ends it): the newest step written, then the thread stops."""
        self.flush(timeout)
        with self.changed:
            self.stopped = True
            self.changed.notify_all()

    def _writer(self) -> None:
        while self._pause(0.0):
            try:
                with self.changed:
                    step = self.newest
                assert step is not None
                self.write(self.path, rundir.RankBeat(step, self.pid, self.host).to_text())
            except Exception as error:  # tried again after a pause; the watchdog sees the beat age meanwhile
                self._failed(error)
                self._pause(HEARTBEAT_RETRY_S, hurry=False)  # a flush must not turn retries into a spin
                continue
            if self.failures:
                print(f"rank heartbeat written again after {self.failures} failed tries", flush=True)
            with self.changed:
                self.written, self.failures = step, 0
                self.changed.notify_all()
            self._pause(HEARTBEAT_EVERY_S)

    def _pause(self, seconds: float, hurry: bool = True) -> bool:
        """Wait `seconds` (unless stopped, or `hurry` and a flush() is waiting), then for a step not yet
        written; False once stopped."""
        with self.changed:
            if seconds:
                self.changed.wait_for(lambda: self.stopped or (hurry and self.waiting > 0), seconds)
            self.changed.wait_for(lambda: self.stopped or self.newest != self.written)
            return not self.stopped

    def _failed(self, error: Exception) -> None:
        self.failures, self.error = self.failures + 1, f"{type(error).__name__}: {error}"
        if self.failures == 1 or self.failures % 10 == 0:
            print(f"warning: rank heartbeat not written (try {self.failures}: {self.error})", flush=True)


REFRESH_S = 2.0  # progress.json is never older than this while steps finish (fab status reads it)


class ProgressFile(Callback):
    """RUN_DIR/progress.json (rank 0's callback): the latest logged step, and the end record; between log
    steps, at most every REFRESH_S, the current step with the last logged values (loss, breakdown) and
    the ETA from the logged step time. From rank 0's own clock: no collective, one small atomic write."""

    def __init__(self, run_dir: Path, max_steps: int, world_size: int, clock: Callable[[], float] = time.time):
        self.path = Path(run_dir) / rundir.PROGRESS
        self.max_steps, self.world_size, self.clock = max_steps, world_size, clock
        self.last: Optional[rundir.Progress] = None
        self.logged: tuple[int, float] = (0, 0.0)  # the last logged step and its time: recent steps start there

    def on_progress(self, step: int, values: dict[str, Any]) -> None:
        record = rundir.Progress(
            step=step, max_steps=self.max_steps, time=self.clock(), world_size=self.world_size, **values
        )
        rundir.write_record(self.path, record)
        self.last, self.logged = record, (step, record.time or 0.0)

    def on_step(self, step: int) -> None:
        last, now = self.last, self.clock()
        if last is None or last.time is None or last.ended or step <= last.step or now - last.time < REFRESH_S:
            return
        recent = (now - self.logged[1]) / (step - self.logged[0])  # evals and checkpoints included: the ETA's
        eta = (self.max_steps - step) * recent
        elapsed = last.elapsed_s + (now - last.time) if last.elapsed_s is not None else None
        speed = last.avg_step_time_s or recent  # none logged yet (step 1's is start-up): the recent steps'
        record = dataclasses.replace(last, step=step, time=now, eta_s=eta, elapsed_s=elapsed, avg_step_time_s=speed)
        rundir.write_record(self.path, record)
        self.last = record


class PhaseMarks(Callback):
    """RUN_DIR/phases.jsonl (rank 0's callback): the first step, each log step, evals, checkpoints, the end
    (cluster_node.protocol.phases; train.train marks the start-up)."""

    def __init__(self, run_dir: Path):
        self.run, self.first = Path(run_dir), True

    def on_step(self, step: int) -> None:
        if self.first:
            self.first = False
            phases.mark(self.run, "first_step", step=step)

    def on_progress(self, step: int, values: dict[str, Any]) -> None:
        phases.mark(self.run, "end" if values.get("ended") else "steps", step=step)

    def on_interval(self, event: str, start: float, end: float, step: int) -> None:
        phases.mark(self.run, event, start, end=end, step=step)


def stacks_on_sigusr2(run_dir: Path, rank: int) -> None:
    """SIGUSR2 appends this rank's Python stacks to RUN_DIR/stacks/rankN.txt (the hang watchdog sends it)."""
    path = Path(run_dir) / rundir.STACKS / rundir.RANK_STACK.format(rank=rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    faulthandler.register(signal.SIGUSR2, file=open(path, "a"), all_threads=True)  # noqa: SIM115 - kept open


def start_wandb(config, run_dir: Path, log: Callable[[str], None]):
    """A W&B run beside TensorBoard when WANDB_API_KEY is set (and wandb installed); else None."""
    if not os.environ.get("WANDB_API_KEY"):
        return None
    try:
        import wandb
    except ImportError:
        log("WANDB_API_KEY is set but wandb is not installed (pip install wandb); TensorBoard only")
        return None
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "gpu-cluster"),
        name=run_dir.name,
        id=run_dir.name,
        resume="allow",
        dir=str(run_dir),
        config=config.to_dict(),
    )
