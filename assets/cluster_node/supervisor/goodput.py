"""Where a run's wall-clock went: the goodput account, from RUN_DIR/phases.jsonl (cluster_node.protocol.phases).
Pure: marks in, an Account out. Every second between the supervisor's `run` and `done` marks gets one
label; where intervals overlap the more specific wins (an eval inside a lost stretch is eval time).
Goodput = productive seconds / wall-clock seconds, productive = stepping whose steps were kept.
The supervisor writes the account into summary.json at the run's end (`record`); fab report, fab runs
and fab drill read it from the marks."""

from __future__ import annotations

import bisect
import dataclasses
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

from cluster_node.protocol import phases, rundir
from cluster_node.protocol.phases import Phase

# Highest priority first; GROUPS gives the headline causes the issue names.
LABELS = (
    "eval",
    "checkpoint",
    "checkpoint.snapshot",
    "warmup",
    "stall",
    "restart.detect",
    "restart.decide",
    "restart.relaunch",
    "restart.first_step",
    "startup.launch",
    "startup.rendezvous",
    "startup.data",
    "startup.first_step",
    "recomputed",
    "productive",
    "shutdown",
)
GROUPS = (
    *("productive", "startup", "warmup", "eval", "checkpoint"),
    *("restart", "recomputed", "stall", "shutdown", "unaccounted"),
)
# trainer event -> label; the batch shapes run before the first step are warm-up, not start-up
SPANS = {"eval": "eval", "checkpoint": "checkpoint", "snapshot": "checkpoint.snapshot", "warm_shapes": "warmup"}
STALL_FACTOR = 2.0  # a log interval slower than this x the run's median step time stalled for the excess
WARM_FACTOR = 1.2  # an attempt's first log intervals slower than this x the median: warming up, for the excess


@dataclass
class Attempt:
    start: float
    marks: dict = field(default_factory=dict)  # event -> the first Phase of it
    steps: list = field(default_factory=list)  # (time, step): first_step and every log step
    spans: list = field(default_factory=list)  # (label, start, end, step): evals, checkpoints, snapshots


@dataclass(frozen=True)
class Incident:
    """One restart's own timeline (seconds) and the steps it cost."""

    kind: str
    at_s: float  # the last heartbeat before the failure, from the run's start
    detect_s: float  # last heartbeat -> detection
    decide_s: float  # detection -> the new spec (clean-up, probe, plan)
    relaunch_s: float  # the new spec -> the trainer ready to step (launch, rendezvous, data, resume)
    first_step_s: float  # ready -> its first step
    steps_lost: int  # finished after the checkpoint or snapshot it resumed from
    lost_s: float  # the stepping time those steps took


@dataclass(frozen=True)
class Account:
    wall_s: float
    phases: dict  # label -> seconds (LABELS + "unaccounted"); they sum to wall_s
    segments: tuple  # (label, start_s, end_s) from the run's start, adjacent ones of a label merged
    incidents: tuple
    steps_kept: Optional[int]
    running: bool

    @property
    def goodput(self) -> float:
        return self.phases.get("productive", 0.0) / self.wall_s if self.wall_s > 0 else 0.0

    def group(self, name: str) -> float:
        return sum(v for k, v in self.phases.items() if k.split(".")[0] == name)


def attempts(marks: Sequence[Phase]) -> tuple[list[Attempt], float, Optional[float]]:
    """Marks (in time order) split at each `launch`; a run started by hand has one attempt at `process`.
    Returns (attempts, the run's start, its end or None while it runs)."""
    ordered = sorted(marks, key=lambda m: m.time)
    start = next((m.time for m in ordered if m.event == "run"), ordered[0].time if ordered else 0.0)
    done = next((m.time for m in ordered if m.event == "done"), None)
    if done is None and not any(m.event == "run" for m in ordered):  # the trainer alone, by hand
        done = next((m.time for m in reversed(ordered) if m.event == "end"), None)
    out: list[Attempt] = []
    for m in ordered:
        if m.event == "launch" or (not out and m.event not in ("run", "done")):
            out.append(Attempt(m.time))
        if not out or m.event in ("run", "done"):
            continue
        now = out[-1]
        if m.event in SPANS:
            now.spans.append((SPANS[m.event], m.time, m.end if m.end is not None else m.time, m.step))
        elif m.event in ("steps", "first_step", "end"):
            now.steps.append((m.time, m.step))
        now.marks.setdefault(m.event, m)
    return out, start, done


def _t(attempt: Attempt, event: str) -> Optional[float]:
    mark = attempt.marks.get(event)
    return mark.time if mark is not None else None


def _stepping_end(attempt: Attempt, end: float) -> float:
    detect = attempt.marks.get("detect")
    if "end" in attempt.marks:
        return attempt.marks["end"].time
    if detect is not None:
        return detect.end if detect.end is not None else detect.time
    return end


def _intervals(runs: list[Attempt], start: float, end: float) -> tuple[list, list[Incident]]:
    spans: list = []
    incidents: list[Incident] = []
    previous: Optional[Attempt] = None
    for attempt in runs:
        ready, first = _t(attempt, "ready"), _t(attempt, "first_step")
        if previous is None:
            process, rendezvous = _t(attempt, "process"), _t(attempt, "rendezvous")
            spans += [("startup.launch", start, process), ("startup.rendezvous", process, rendezvous)]
            spans += [("startup.data", rendezvous, ready), ("startup.first_step", ready, first)]
        else:
            decided = _t(previous, "decide") or _t(previous, "detect")
            spans += [("restart.relaunch", decided, ready), ("restart.first_step", ready, first)]
            if "decide" in previous.marks and incidents:
                incidents[-1] = _relaunch(incidents[-1], previous, attempt)
        stop = _stepping_end(attempt, end)
        spans.append(("productive", first, stop))
        spans += [(event, s, e) for event, s, e, _ in attempt.spans]
        if "detect" in attempt.marks:
            spans += _failure(attempt, stop, end, incidents, start)
        previous = attempt
    if runs and "end" in runs[-1].marks:
        spans.append(("shutdown", runs[-1].marks["end"].time, end))
    spans += _stalls(runs) + _warmups(runs)
    return [s for s in spans if s[1] is not None and s[2] is not None and s[2] > s[1]], incidents


def _failure(attempt: Attempt, beat: float, end: float, incidents: list, start: float) -> list:
    """A failed attempt: detection, decision (or the end), the stepping it loses."""
    detect, decide = attempt.marks["detect"], attempt.marks.get("decide")
    if decide is None:  # no restart: the run ended; nothing was detected for a restart, nothing recomputed
        return [("shutdown", beat, end)]
    resume = decide.step  # a checkpoint's or a snapshot's: the recomputation starts after its copy
    saved = [e for label, _, e, step in attempt.spans if label.startswith("checkpoint") and step == resume]
    lost_from = max(saved) if saved else _t(attempt, "first_step")
    spans = [("restart.detect", beat, detect.time), ("recomputed", lost_from, beat)]
    spans.append(("restart.decide", detect.time, decide.time))
    lost = (detect.step or 0) - (resume or 0) if detect.step is not None else 0
    lost_s = max(0.0, beat - lost_from) if lost_from is not None else 0.0  # a checkpoint after the beat
    incidents.append(
        Incident(detect.kind or "?", beat - start, detect.time - beat, decide.time - detect.time, 0, 0, lost, lost_s)
    )
    return spans


def _relaunch(incident: Incident, failed: Attempt, later: Attempt) -> Incident:
    decided, ready, first = _t(failed, "decide"), _t(later, "ready"), _t(later, "first_step")
    relaunch = ready - decided if ready is not None and decided is not None else 0.0
    # the batch shapes run before the first step are the account's warm-up there, not relaunch
    relaunch -= sum(end - start for label, start, end, _ in later.spans if label == "warmup")
    first_step = first - ready if first is not None and ready is not None else 0.0
    return Incident(**{**incident.__dict__, "relaunch_s": relaunch, "first_step_s": first_step})


def _rows(attempt: Attempt) -> list[tuple[float, int, float]]:
    """(end, steps, seconds stepping) of each log interval, evals and checkpoints inside taken out."""
    rows = []
    steps = sorted((t, s) for t, s in attempt.steps if s is not None)
    for (t0, s0), (t1, s1) in zip(steps, steps[1:]):
        inside = sum(max(0.0, min(e, t1) - max(b, t0)) for _, b, e, _ in attempt.spans)
        if s1 > s0:
            rows.append((t1, s1 - s0, t1 - t0 - inside))
    return rows


def _median(runs: list[Attempt]) -> Optional[float]:
    rates = [d / n for attempt in runs for _, n, d in _rows(attempt)]
    return statistics.median(rates) if rates else None


def _stalls(runs: list[Attempt]) -> list:
    """Log intervals whose time per step exceeds STALL_FACTOR x the run's median: the excess, at the
    interval's end."""
    median = _median(runs)
    if median is None:
        return []
    rows = [row for attempt in runs for row in _rows(attempt)]
    return [("stall", t1 - (d - n * median), t1) for t1, n, d in rows if d > STALL_FACTOR * n * median]


def _warmups(runs: list[Attempt]) -> list:
    """Each attempt's first log intervals while they run slower than WARM_FACTOR x the run's median step (a
    GPU's kernel plans and caches filling after a start or a restart, issue 29): the excess, at each one's
    end. The first step itself is start-up (startup.first_step, restart.first_step)."""
    median = _median(runs)
    if median is None:
        return []
    spans = []
    for attempt in runs:
        for t1, n, d in _rows(attempt):
            if d <= WARM_FACTOR * n * median:
                break
            spans.append(("warmup", t1 - (d - n * median), t1))
    return spans


def paint(spans: list, start: float, end: float) -> tuple[dict, list]:
    """Each elementary stretch of [start, end] gets the highest-priority label covering it."""
    cuts = sorted({start, end, *(min(max(t, start), end) for _, a, b in spans for t in (a, b))})
    labels: list[Optional[str]] = [None] * (len(cuts) - 1)
    for painted in reversed(LABELS):  # lowest priority first: later paint wins
        for name, a, b in spans:
            if name != painted:
                continue
            lo, hi = bisect.bisect_left(cuts, max(a, start)), bisect.bisect_left(cuts, min(b, end))
            for i in range(lo, hi):
                labels[i] = painted
    totals = {label: 0.0 for label in (*LABELS, "unaccounted")}
    segments: list = []
    for i, found in enumerate(labels):
        name, a, b = found or "unaccounted", cuts[i] - start, cuts[i + 1] - start
        totals[name] += b - a
        if segments and segments[-1][0] == name and abs(segments[-1][2] - a) < 1e-9:
            segments[-1] = (name, segments[-1][1], b)
        else:
            segments.append((name, a, b))
    return totals, segments


def account(marks: Sequence[Phase], now: Optional[float] = None) -> Optional[Account]:
    """The account of a run's marks; None when there are none. A running run is accounted up to `now`
    (else its newest mark). A run resumed by a later `fab train` has a segment per launch (each begins at
    a `run` mark): the account is theirs end to end, the time between them (no cluster at work) left out."""
    ordered = sorted(marks, key=lambda m: m.time)
    begins = [i for i, m in enumerate(ordered) if m.event == "run"][1:]
    parts = [ordered[a:b] for a, b in zip([0, *begins], [*begins, len(ordered)])]
    accounts = [a for a in (_segment(p, now) for p in parts) if a is not None]
    return _joined(accounts) if len(accounts) > 1 else (accounts[0] if accounts else None)


def _segment(marks: Sequence[Phase], now: Optional[float]) -> Optional[Account]:
    runs, start, done = attempts(marks)
    if not runs:
        return None
    end = done if done is not None else max([now or 0.0, *(m.time for m in marks)])
    spans, incidents = _intervals(runs, start, end)
    totals, segments = paint(spans, start, end)
    last = runs[-1].steps[-1][1] if runs[-1].steps else None
    return Account(end - start, totals, tuple(segments), tuple(incidents), last, done is None)


def _joined(accounts: list[Account]) -> Account:
    """Segments one after the other: their times offset by the wall-clock before them."""
    offset, segments, incidents = 0.0, [], []
    phases_s: dict[str, float] = {}
    for acc in accounts:
        for label, seconds in acc.phases.items():
            phases_s[label] = phases_s.get(label, 0.0) + seconds
        segments += [(label, a + offset, b + offset) for label, a, b in acc.segments]
        incidents += [replace(i, at_s=i.at_s + offset) for i in acc.incidents]
        offset += acc.wall_s
    last = accounts[-1]
    return Account(offset, phases_s, tuple(segments), tuple(incidents), last.steps_kept, last.running)


def _s(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def lines(acc: Optional[Account]) -> list[str]:
    """The account for a terminal: the goodput, each cause with its parts, one line per restart."""
    if acc is None:
        return [f"goodput: no {rundir.PHASES} (a run from an older supervisor/trainer)"]
    state = " so far" if acc.running else ""
    out = [
        f"goodput {acc.goodput:.0%}{state}: {_s(acc.phases['productive'])} of {_s(acc.wall_s)} wall-clock "
        f"produced steps that were kept (step {acc.steps_kept})"
    ]
    for group in GROUPS[1:]:
        total = acc.group(group)
        parts = [(k.split(".", 1)[1], v) for k, v in acc.phases.items() if k.startswith(group + ".") and v > 0]
        detail = f" ({', '.join(f'{k} {_s(v)}' for k, v in parts)})" if parts else ""
        if total > 0:
            out.append(f"  {group}: {_s(total)} ({total / acc.wall_s:.0%}){detail}")
    for i, r in enumerate(acc.incidents, 1):
        out.append(
            f"  restart {i} ({r.kind}, at {_s(r.at_s)}): detected {_s(r.detect_s)} after the last step, decided "
            f"in {_s(r.decide_s)}, relaunched in {_s(r.relaunch_s)}, first step {_s(r.first_step_s)}; "
            f"{r.steps_lost} steps lost ({_s(r.lost_s)} to recompute)"
        )
    return out


def short(acc: Optional[Account]) -> str:
    """`fab runs`'s goodput column."""
    return "" if acc is None else f"{acc.goodput:.0%}" + ("*" if acc.running else "")


def as_json(acc: Account) -> dict:
    """summary.json's `goodput`: the share, the wall-clock by cause (GROUPS) and by phase, each restart."""
    return {
        "goodput": round(acc.goodput, 4),
        "wall_s": round(acc.wall_s, 3),
        "by_cause_s": {group: round(acc.group(group), 3) for group in GROUPS},
        "phases_s": {label: round(seconds, 3) for label, seconds in acc.phases.items() if seconds > 0},
        "restarts": [dataclasses.asdict(incident) for incident in acc.incidents],
        "steps_kept": acc.steps_kept,
    }


def record(run: Path) -> None:
    """At the run's end (after the supervisor's `done` mark): the account into the trainer's summary.json,
    when there is one. Never fails the caller: the marks stay, fab report accounts from them."""
    try:
        summary = rundir.read_json(Path(run) / rundir.SUMMARY)
        acc = account(phases.read(Path(run)))
        if isinstance(summary, dict) and acc is not None:
            rundir.write_json(Path(run) / rundir.SUMMARY, {**summary, "goodput": as_json(acc)}, indent=2)
    except (OSError, ValueError, TypeError):
        pass
