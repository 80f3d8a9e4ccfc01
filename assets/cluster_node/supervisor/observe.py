"""One poll of a running attempt: what the supervisor decides on. Reads the run directory (rank heartbeats,
progress.json, STOP, FORCED, interruptions.json) and asks `ssh_ok(host)` whether each node answers; the
clock and ssh are injected, so a test can script both."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from cluster_node.protocol import rundir
from cluster_node.protocol.spec import RunSpec
from cluster_node.supervisor import restart_plan


@dataclass(frozen=True)
class Observation:
    """What one poll saw. At most one of unreachable/hang/stall/start_timeout is set (in that order of
    precedence, as the launcher checked them)."""

    now: float
    exited: Optional[int] = None  # mpirun's exit code, once it ended
    first_step: bool = False  # a heartbeat or progress of this attempt
    unreachable: Optional[str] = None  # the node that missed `limits.unreachable` checks in a row
    hang: Optional[tuple[int, int]] = None  # (age of the newest heartbeat, hang window), age > window
    stall: Optional[int] = None  # age of progress.json, over limits.stall, no heartbeats
    start_timeout: bool = False  # no step within limits.start
    stop_requested: bool = False  # STOP (fab stop, or a Spot watcher)
    forced: bool = False  # FORCED (fab stop --force)
    own_notice: Optional[rundir.Interruption] = None  # a Spot notice for the supervisor's own node


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def newest_beat(run: Path) -> float:
    """mtime of the newest per-rank heartbeat (ranks/rankN), 0 if none."""
    return max((_mtime(p) for p in (run / rundir.RANKS).glob("rank*")), default=0.0)


def hang_window(run: Path, limits) -> int:
    """max(hang_factor x the measured step time, hang_floor), at most limits.stall; whole seconds up."""
    progress = rundir.read_record(run / rundir.PROGRESS, rundir.Progress)
    average = (progress.avg_step_time_s if progress else None) or 0.0
    return math.ceil(min(max(average * limits.hang_factor, limits.hang_floor), limits.stall))


class Observer:
    """Polls one attempt; counts each node's missed ssh checks across polls."""

    def __init__(self, run: Path, spec: RunSpec, ssh_ok: Callable[[str], bool], clock: Callable[[], float]):
        self.run, self.spec, self.ssh_ok, self.clock = run, spec, ssh_ok, clock
        self.started = clock()
        self.failures: dict[str, int] = {}

    def own_notice(self) -> Optional[rundir.Interruption]:
        return restart_plan.notices(self.run, self.started).get(self.spec.supervisor_host)

    def observe(self, exited: Optional[int]) -> Observation:
        flags = dict(
            stop_requested=(self.run / rundir.STOP).exists(),
            forced=(self.run / rundir.FORCED).exists(),
            own_notice=self.own_notice(),
        )
        now = self.clock()
        if exited is not None:
            return Observation(now, exited=exited, **flags)  # type: ignore[arg-type]
        lost = self._unreachable()
        if lost:
            return Observation(now, unreachable=lost, **flags)  # type: ignore[arg-type]
        return self._progress(now, flags)

    def _unreachable(self) -> Optional[str]:
        for host in self.spec.hosts:
            self.failures[host] = 0 if self.ssh_ok(host) else self.failures.get(host, 0) + 1
            if self.failures[host] >= self.spec.limits.unreachable:
                return host
        return None

    def _progress(self, now: float, flags: dict) -> Observation:
        beat, limits = newest_beat(self.run), self.spec.limits
        progress = _mtime(self.run / rundir.PROGRESS)
        if beat >= int(self.started):
            age, window = int(now - beat), hang_window(self.run, limits)
            hang = (age, window) if age > window else None
            return Observation(now, first_step=True, hang=hang, **flags)
        if progress >= int(self.started):
            age = int(now - progress)
            return Observation(now, first_step=True, stall=age if age > limits.stall else None, **flags)
        return Observation(now, start_timeout=now - self.started > limits.start, **flags)
