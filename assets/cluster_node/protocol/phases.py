"""RUN_DIR/phases.jsonl: the boundaries of a run's wall-clock, one JSON line each, appended where they happen:
the supervisor (the run, each attempt's launch, a failure's detection, the restart decision, the end) and the
trainer's rank 0 (its process start, the rendezvous, the batch shapes run before the first step, ready to
step, the first step, each log step, every eval, checkpoint and snapshot, its end).
cluster_node.supervisor.goodput turns them into the goodput account.
Recording never fails the caller: a phase line lost is a gap in the account, not a lost run."""

from __future__ import annotations

import fcntl
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

from cluster_node.protocol import rundir
from cluster_node.protocol.rundir import Record, RecordError, _key

# supervisor: run, launch, detect (`kind`; the newest rank heartbeat's step in `step`, its time in `end`),
# decide (the resume step), done. trainer (rank 0): process, rendezvous, ready (the step it starts from),
# first_step, steps (each log step), eval, checkpoint and snapshot (time .. end: the loop's stall), end; and
# warm_shapes (time .. end: the batch shapes run once before the first step, train.perf.warm_shapes).
SUPERVISOR_EVENTS = ("run", "launch", "detect", "decide", "done")
TRAINER_EVENTS = (
    *("process", "rendezvous", "warm_shapes", "ready", "first_step", "steps"),
    *("eval", "checkpoint", "snapshot", "end"),
)


@dataclass(frozen=True)
class Phase(Record):
    """One line of phases.jsonl."""

    FILE: ClassVar[str] = rundir.PHASES
    event: str = _key("str", required=True)
    time: float = _key("float", required=True)  # epoch s; an interval's start
    end: Optional[float] = _key("float")  # eval, checkpoint: the interval's end; detect: the last beat
    step: Optional[int] = _key("int")
    kind: Optional[str] = _key("str")  # detect, decide, done: a rundir.EndKind


def mark(run: Path, event: str, when: Optional[float] = None, **fields) -> None:
    """Append one Phase line under `fcntl.lockf` (the supervisor and rank 0 both append), in one write; an
    OSError is swallowed (see the module's docstring). EFS takes NFSv4 byte-range locks but only as advisory
    ones: "All locks in Amazon EFS are advisory, which means that READ and WRITE operations do not check
    for conflicting locks" (EFS User Guide, "Unsupported NFSv4 features", mandatory locking), so every
    appender must take the lock itself, as both do here."""
    record = Phase(event=event, time=time.time() if when is None else when, **fields)
    try:
        with open(Path(run) / rundir.PHASES, "a") as handle:
            fcntl.lockf(handle, fcntl.LOCK_EX)
            handle.write(json.dumps(record.to_json()) + "\n")
            handle.flush()
    except OSError:
        pass


def read(run: Path) -> tuple[Phase, ...]:
    """The run's Phase lines in file order; () when there are none; a torn or foreign line is skipped."""
    try:
        lines = (Path(run) / rundir.PHASES).read_text(errors="replace").splitlines()
    except OSError:
        return ()
    return parse(lines)


def parse(lines) -> tuple[Phase, ...]:
    out = []
    for line in lines:
        try:
            out.append(Phase.from_json(json.loads(line)))
        except (ValueError, RecordError):
            continue
    return tuple(out)


def last_beat(run: Path) -> tuple[Optional[int], Optional[float]]:
    """The furthest step any rank finished in this attempt (ranks/rankN) and the newest heartbeat's time."""
    steps, times = [], []
    for path in (Path(run) / rundir.RANKS).glob("rank*"):
        try:
            beat = rundir.RankBeat.from_text(path.read_text())
            times.append(path.stat().st_mtime)
        except (OSError, RecordError):
            continue
        steps.append(beat.step)
    return (max(steps) if steps else None), (max(times) if times else None)
