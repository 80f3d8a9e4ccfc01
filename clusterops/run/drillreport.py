"""`fab drill`'s printout: what the supervisor did (its log lines, restarts.json, run-status), the
incident's timeline from phases.jsonl (seconds from the injection) and the goodput it cost: the
goodput account (cluster_node.supervisor.goodput) just before the injection against the one at the drill's end."""

from __future__ import annotations

import calendar
import re
import time
from typing import Optional, Sequence

from cluster_node.protocol import rundir
from cluster_node.protocol.phases import Phase
from cluster_node.protocol.rundir import Restart, RunStatus
from cluster_node.supervisor import goodput

TIMELINE = ("detect", "decide", "launch", "process", "rendezvous", "ready", "first_step", "checkpoint", "end", "done")
SUPERVISOR_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ")  # the supervisor's and Spot watcher's
MAX_LOG_LINES = 12
MAX_CHECKPOINTS = 2  # the ones right after the injection (a Spot notice's); later ones are routine


def _epoch(iso: str) -> float:
    try:
        return calendar.timegm(time.strptime(iso, "%Y-%m-%dT%H:%M:%SZ"))
    except (TypeError, ValueError):
        return 0.0


def _from(r: Restart) -> str:
    if r.resume_step is None:
        return "from the start (no checkpoint or snapshot yet)"
    holder = (r.names or {}).get(r.resume_holder or "", r.resume_holder)
    where = "the checkpoint"
    if r.resume_from == "snapshot":
        where = f"{holder}'s snapshot (copied to /data)" if holder else "the nodes' own snapshots"
    lost = f"; lost {r.steps_lost} steps" if r.steps_lost is not None else ""
    lost += f", {r.lost_s:.1f} s" if r.steps_lost is not None and r.lost_s is not None else ""
    return f"from {where} at step {r.resume_step}{lost}"


def _what(m: Phase, attempt: int) -> str:
    kind = f" ({m.kind})" if m.kind else ""
    if m.event == "detect":
        beat = f"; its last heartbeat: step {m.step}" if m.step is not None else ""
        return f"supervisor detected the failure{kind}{beat}"
    return {
        "decide": "supervisor decided: restart "
        + (f"from step {m.step}" if m.step is not None else "from the start (no checkpoint or snapshot yet)"),
        "launch": f"supervisor launched attempt {attempt}",
        "process": "rank 0's trainer started",
        "rendezvous": "ranks met (rendezvous)",
        "ready": f"ready to step, from step {m.step}",
        "first_step": f"first step ({m.step})",
        "checkpoint": f"checkpoint at step {m.step}",
        "end": f"the trainer ended at step {m.step}",
        "done": f"supervisor ended the run{kind}",
    }[m.event]


def timeline(marks: Sequence[Phase], started: float) -> list[str]:
    """The marks after the injection, `+S s  what` each."""
    attempt = sum(1 for m in marks if m.event == "launch" and m.time < started)
    out, checkpoints = ["  +0.0 s  injected"], 0
    for m in sorted(marks, key=lambda m: m.time):
        if m.time < started or m.event not in TIMELINE:
            continue
        attempt += m.event == "launch"
        checkpoints += m.event == "checkpoint"
        if m.event != "checkpoint" or checkpoints <= MAX_CHECKPOINTS:
            out.append(f"  +{m.time - started:.1f} s  {_what(m, attempt)}")
    if checkpoints > MAX_CHECKPOINTS:
        out.append(f"  (and {checkpoints - MAX_CHECKPOINTS} more checkpoints)")
    return out


def lost(marks: Sequence[Phase], started: float, ended: float) -> list[str]:
    """Goodput lost: the drill's wall-clock less the kept stepping it added, by cause. It can exceed the
    drill's wall-clock: steps recomputed after a restart turn earlier productive time into `recomputed`."""
    before = goodput.account([m for m in marks if m.time <= started], now=started)
    after = goodput.account(marks, now=ended)
    if before is None or after is None:
        return [f"goodput: no {rundir.PHASES} (a run from an older supervisor/trainer)"]
    wall, productive = after.wall_s - before.wall_s, after.phases["productive"] - before.phases["productive"]
    deltas = {k: after.phases[k] - before.phases.get(k, 0.0) for k in after.phases if k != "productive"}
    causes = ", ".join(f"{k} {v:.1f} s" for k, v in deltas.items() if abs(v) >= 0.05)
    out = [
        f"goodput lost: {wall - productive:.1f} s"
        + (f" ({causes})" if causes else "")
        + f" in the drill's {wall:.1f} s; the run's goodput {before.goodput:.0%} -> {after.goodput:.0%}"
    ]
    if len(after.incidents) > len(before.incidents):
        r = after.incidents[-1]
        out.append(
            f"incident ({r.kind}): detected {r.detect_s:.1f} s after the last step, decided in {r.decide_s:.1f} s, "
            f"relaunched in {r.relaunch_s:.1f} s, first step {r.first_step_s:.1f} s later; "
            f"{r.steps_lost} steps lost ({r.lost_s:.1f} s to recompute)"
        )
    return out


def _short(line: str, width: int = 200) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def supervisor(
    log_lines: Sequence[str], restarts: Sequence[Restart], status: Optional[RunStatus], started: float
) -> list[str]:
    """What the supervisor did: its log lines since the injection, its new restart records, the status."""
    own = [_short(line) for line in log_lines if SUPERVISOR_LINE.match(line)]
    out = ["supervisor:"] + [f"  | {line}" for line in own[-MAX_LOG_LINES:]]
    if len(own) > MAX_LOG_LINES:
        out.insert(1, f"  | ({len(own) - MAX_LOG_LINES} earlier lines in {rundir.TRAIN_LOG})")
    for number, r in enumerate(restarts, 1):
        if _epoch(r.time) < int(started):
            continue
        dropped = ", ".join(f"{k} ({v})" for k, v in r.dropped.items()) or "none"
        out.append(
            f"  restart {number} ({r.kind}): {r.reason}; dropped {dropped}; "
            f"{len(r.nodes_after)} node(s) on, global batch {r.global_batch} "
            f"({r.batch_per_gpu} per rank x {r.grad_accum} accumulated), {_from(r)}"
        )
    reason = f": {status.reason}" if status and status.reason else ""
    out.append(f"  run-status: {status.state if status else '?'}{reason}")
    return out


def lines(
    head: str,
    watch,
    ended: float,
    outcome: str,
    marks: Sequence[Phase],
    log_lines: Sequence[str],
    restarts: Sequence[Restart],
    status: Optional[RunStatus],
) -> list[str]:
    verdict = {
        "relaunched": "the supervisor restarted the run and it is stepping again",
        "ended": "the run ended",
        "held": "the fault was held, then undone; the run went on (accounted up to its next log step)",
        "no action": "the supervisor had not acted when the drill stopped waiting (--wait)",
    }[outcome]
    out = [head, f"outcome after {ended - watch.started:.1f} s: {verdict}"]
    out += supervisor(log_lines, restarts, status, watch.started)
    out += ["timeline (seconds from the injection):"] + timeline(marks, watch.started)
    out += lost(marks, watch.started, ended)
    return out
