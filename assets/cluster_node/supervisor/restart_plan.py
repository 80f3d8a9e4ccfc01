"""After a failed attempt: restart on the healthy nodes of the run's pool from the newest state a node holds,
or give up (the decisions that were clusterops/supervise.py `plan` and `spot`). Pure given the run
directory's files: the probes (with the snapshots each node holds), the Spot notices, config.json,
restarts.json, the checkpoints."""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from cluster_node.programs import health
from cluster_node.protocol import rundir
from cluster_node.protocol.spec import Batch, RunSpec, sized_by_tokens, trained_global_batch


def last_checkpoint_step(run: Path) -> Optional[int]:
    steps = [rundir.checkpoint_step(p) for p in (run / rundir.CHECKPOINTS).glob(rundir.CHECKPOINT_GLOB)]
    return max((step for step in steps if step is not None), default=None)


def last_step(run: Path) -> Optional[int]:
    """The attempt's last finished step: the newest rank heartbeat (progress.json lags by up to log_every)."""
    steps = []
    for path in (run / rundir.RANKS).glob("rank*"):
        try:
            steps.append(rundir.RankBeat.from_text(path.read_text()).step)
        except (OSError, rundir.RecordError):
            continue
    progress = rundir.read_record(run / rundir.PROGRESS, rundir.Progress)
    return max(steps) if steps else (progress.step if progress else None)


def resumes_from(step: Optional[int]) -> str:
    return "the start" if step is None else f"step {step}"


@dataclass(frozen=True)
class ResumePoint:
    """The newest state a restart can resume from (resume_point): the newest checkpoint on /data, or the
    snapshots every node of the next attempt holds in memory (each rank reads its own node's), or one node's
    newer snapshot that `holder` copies into the run's checkpoints first (cluster_node.programs.snapshots
    persist): a replaced node, a survivor whose last write was cut short."""

    step: Optional[int]
    source: str = "checkpoint"  # or "snapshot"
    holder: Optional[str] = None  # a snapshot to copy to /data first; None: each node reads its own
    bytes: int = 0  # the copy's size (its time limit)

    @property
    def copy(self) -> bool:
        return self.source == "snapshot" and self.holder is not None

    def words(self, spec: RunSpec) -> str:
        if self.step is None:
            return "the start"
        if self.copy and self.holder is not None:
            return f"{spec.name(self.holder)}'s snapshot at step {self.step}, copied to /data"
        if self.source == "snapshot":
            return f"the nodes' own snapshots at step {self.step}"
        return f"the checkpoint at step {self.step}"


def held_snapshots(run: Path, hosts: Iterable[str]) -> dict[str, tuple[int, int]]:
    """host -> (step, bytes) of its snapshot of this run, from the probes (cluster_node.programs.probe)."""
    out = {}
    for host in hosts:
        try:
            facts = health.parse_probe((run / rundir.PROBES / host).read_text())
            held = (facts.get("snapshots") or {}).get(run.resolve().name, {})
            step, size = held.get("step"), held.get("bytes", 0)
        except (OSError, ValueError, IndexError, AttributeError):
            continue
        if isinstance(step, int):
            out[host] = (step, size if isinstance(size, int) else 0)
    return out


def resume_point(
    run: Path, pool: Iterable[str], next_hosts: Sequence[str], snapshots: bool = True, copy: bool = True
) -> ResumePoint:
    """What the trainer of the next attempt will resume from (train.checkpoint.load_agreed: the nodes' own
    snapshots when every rank holds one at the same step, as new as the newest checkpoint or newer), or a
    newer snapshot any node that answered holds (a dropped node still answering included: a Spot notice
    leaves two minutes, a bad GPU leaves RAM intact), to be copied first (`copy` False: the copy failed).
    A snapshot past the run's last heartbeat at the first restart is an older run's of the same name, and a
    run with --snapshot-seconds 0 takes none: neither is this run's state."""
    checkpoint, last = last_checkpoint_step(run), last_step(run)
    config = rundir.read_json(run / rundir.CONFIG, {}) or {}
    snapshots = snapshots and config.get("snapshot_seconds") != 0  # its trainer reads none: an older run's
    held = held_snapshots(run, pool) if snapshots else {}
    if last is not None and not rundir.read_list(run / rundir.RESTARTS, rundir.Restart):
        # The first restart only: later attempts' heartbeats start over (and lag), and the first attempt's
        # trainers have dropped a namesake's snapshots by then.
        held = {h: v for h, v in held.items() if v[0] <= last}
    floor = -1 if checkpoint is None else checkpoint
    theirs = {held[h][0] if h in held else None for h in next_hosts}
    together = next(iter(theirs)) if len(theirs) == 1 else None
    holder = max(held, key=lambda h: (held[h][0], h in next_hosts), default=None)
    newest = held[holder][0] if holder is not None else None
    if copy and holder is not None and newest is not None and newest > max(floor, together or -1):
        return ResumePoint(newest, "snapshot", holder, held[holder][1])
    if together is not None and together >= floor:
        return ResumePoint(together, "snapshot")
    return ResumePoint(checkpoint)


def step_time(run: Path) -> Optional[float]:
    progress = rundir.read_record(run / rundir.PROGRESS, rundir.Progress)
    return progress.avg_step_time_s if progress else None


def lost_work(run: Path, point: ResumePoint, spec: RunSpec) -> tuple[int, Optional[float], str]:
    """(steps lost, their stepping seconds or None, the words): "lost 3 steps, 2.1 s since node1's snapshot
    at step 412: snapshots every 60 s" (the bound that applies to where the restart resumes from)."""
    config = rundir.read_json(run / rundir.CONFIG, {}) or {}
    every, minutes, seconds = (config.get(k) for k in ("checkpoint_every", "checkpoint_minutes", "snapshot_seconds"))
    last, per_step = last_step(run), step_time(run)
    lost = 0 if last is None else max(0, last - (point.step or 0))
    lost_s = lost * per_step if per_step is not None else None
    took = f", {lost_s:.1f} s" if lost_s is not None else ""
    if point.source == "snapshot":
        bound = f"snapshots every {seconds:g} s" if seconds else "no snapshot interval known"
    else:
        bound = f"the recipe checkpoints every {every} steps" if every else "no checkpoint interval known"
        bound += f" or {minutes:g} minutes" if minutes else ""
    return lost, lost_s, f"lost {lost} steps{took} since {point.words(spec)}: {bound}"


def rebalance(global_batch: int, ranks: int, max_per_rank: int, fixed: bool = False) -> Optional[tuple[int, int]]:
    """(batch per rank, accumulation) giving `global_batch` over `ranks` with micro-batches of at
    most `max_per_rank`; None when the global batch does not split evenly over the ranks. `fixed`: micro-batches of
    exactly `max_per_rank` (a token-sized run's: sized_by_tokens), only the accumulation moves."""
    if global_batch <= 0 or global_batch % ranks:
        return None
    share = global_batch // ranks
    if fixed:
        return (max_per_rank, share // max_per_rank) if share % max_per_rank == 0 else None
    for accum in range(1, share + 1):
        if share % accum == 0 and share // accum <= max_per_rank:
            return share // accum, accum
    return None


def judge(run: Path, hosts: Iterable[str], gpus_per_node: int) -> dict[str, list[str]]:
    """host -> reasons it must not train (empty: healthy), from RUN_DIR/probes/HOST (probe output)."""
    facts: dict[str, Optional[dict]] = {}
    for host in hosts:
        try:
            facts[host] = health.parse_probe((run / rundir.PROBES / host).read_text())
        except (OSError, ValueError, IndexError):
            facts[host] = None
    verdicts = health.assess(facts, gpus_per_node if any(f and f["gpus"] for f in facts.values()) else 0, None)
    return {v.node: (v.reasons if v.verdict == "bad" else []) for v in verdicts}


def noticed_at(entry: rundir.Interruption) -> Optional[int]:
    try:
        return calendar.timegm(time.strptime(entry.noticed, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return None


def notices(run: Path, since: float) -> dict[str, rundir.Interruption]:
    """host -> its Spot notice, of those the nodes' watchers recorded (interruptions.json, spotwatch) at
    or after `since` (epoch s; the record keeps whole seconds)."""
    out = {}
    for entry in rundir.read_list(run / rundir.INTERRUPTIONS, rundir.Interruption):
        when = noticed_at(entry)
        if entry.host and when is not None and when >= int(since):
            out[entry.host] = entry
    return out


def notice_line(entry: rundir.Interruption) -> str:
    return f"Spot {entry.action or 'interruption'} at {entry.action_time or 'an unknown time'}"


def spot_ended(run: Path, hosts: Iterable[str], since: float) -> Optional[str]:
    """Why to restart an attempt on `hosts` that ended cleanly, but early, because one of them got a
    Spot notice since `since` (its watcher asked the trainer to checkpoint now); None otherwise."""
    current = set(hosts)
    hit = {host: notice_line(e) for host, e in notices(run, since).items() if host in current}
    progress = rundir.read_record(run / rundir.PROGRESS, rundir.Progress)
    config = rundir.read_json(run / rundir.CONFIG, {}) or {}
    if not hit or (progress.step if progress else 0) >= config.get("max_steps", float("inf")):
        return None
    return "spot notice: " + "; ".join(f"{host}: {why}" for host, why in hit.items())


@dataclass(frozen=True)
class Plan:
    """A restart: the next spec and the restarts.json entry; or a refusal (spec None, line says why)."""

    line: str
    spec: Optional[RunSpec] = None
    record: Optional[rundir.Restart] = None
    point: Optional[ResumePoint] = None


def _batch(run: Path, spec: RunSpec, history: tuple[rundir.Restart, ...]) -> Union[tuple[int, int, bool], str]:
    """(global batch, largest micro-batch, whether only the accumulation may move) the run keeps, or why there
    is nothing to resume."""
    config = rundir.read_json(run / rundir.CONFIG, {})
    if not config:
        return "no config.json: the run never started training, nothing to resume"
    fixed = sized_by_tokens(config)
    if history:
        return history[-1].global_batch, history[0].max_batch_per_gpu, fixed
    return trained_global_batch(config, spec) or 0, config["batch_per_gpu"], fixed


def plan(
    run: Path,
    spec: RunSpec,
    kind: rundir.EndKind,
    reason: str,
    since: float = 0.0,
    now: Optional[float] = None,
    copy: bool = True,
) -> Plan:
    """Restart on the healthy nodes of the pool, the same global batch, from the newest state (ResumePoint;
    `copy` False: none that must be copied to /data first); the nodes with a Spot notice since `since` are left
    out too, whatever ended the attempt: they still answer, for two minutes."""
    history = rundir.read_list(run / rundir.RESTARTS, rundir.Restart)
    allowed = spec.limits.max_restarts
    if len(history) >= allowed:
        return Plan(f"restarts exhausted ({len(history)}/{allowed})")
    kept = _batch(run, spec, history)
    if isinstance(kept, str):
        return Plan(kept)
    global_batch, max_per_rank, fixed = kept
    verdicts = judge(run, spec.pool, spec.slots)
    for host, entry in notices(run, since).items():  # whatever ended the attempt: a noticed node will go
        verdicts[host] = [*verdicts.get(host, []), notice_line(entry)]
    healthy = tuple(h for h in spec.pool if not verdicts.get(h))
    dropped = {h: "; ".join(verdicts[h]) for h in spec.pool if verdicts.get(h)}
    named = ", ".join(f"{spec.name(h)} ({why})" for h, why in dropped.items())
    if len(healthy) < spec.limits.min_nodes:
        return Plan(f"{len(healthy)} healthy node(s) left, --min-nodes {spec.limits.min_nodes} (dropped: {named})")
    split = rebalance(global_batch, len(healthy) * spec.slots, max_per_rank, fixed)
    if split is None:
        return Plan(f"the global batch {global_batch} does not split evenly over {len(healthy) * spec.slots} ranks")
    point = resume_point(run, spec.pool, healthy, copy=copy)
    lost, lost_s, lost_words = lost_work(run, point, spec)
    record = rundir.Restart(
        time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        kind=kind,
        reason=reason,
        nodes_before=spec.hosts,
        nodes_after=healthy,
        dropped=dropped,
        rejoined=tuple(h for h in healthy if h not in spec.hosts),
        resume_step=point.step,
        global_batch=global_batch,
        batch_per_gpu=split[0],
        grad_accum=split[1],
        max_batch_per_gpu=max_per_rank,
        names={h: spec.name(h) for h in spec.pool} if spec.names else None,
        resume_from=point.source if point.step is not None else None,
        resume_holder=point.holder,
        steps_lost=lost,
        lost_s=round(lost_s, 3) if lost_s is not None else None,
    )
    line = (
        f"restart {len(history) + 1}/{allowed} on {len(healthy)} node(s) {spec.names_of(healthy, ' ')} from "
        f"{point.words(spec)} ({lost_words}); batch {split[0]}/rank x accumulation {split[1]} (global {global_batch})"
        + (f"; dropped {named}" if dropped else "")
    )
    return Plan(line, spec.restart(healthy, Batch(split[0], split[1], global_batch)), record, point)


def history_lines(restarts: list[dict]) -> list[str]:
    """restarts.json for people: one line per restart, nodes by their inventory names where recorded."""
    lines = []
    for i, r in enumerate(restarts, 1):
        names = r.get("names") or {}
        after, dropped, rejoined = ([names.get(h, h) for h in r[key]] for key in ("nodes_after", "dropped", "rejoined"))
        lines.append(
            f"  restart {i}: {r['time']} {r['kind']}: {r['reason'][:160]}; resumed from "
            f"{_source(r, names)}{resumes_from(r['resume_step'])} on {len(after)} node(s) {' '.join(after)}"
            + (f", dropped {', '.join(dropped)}" if dropped else "")
            + (f", rejoined {', '.join(rejoined)}" if rejoined else "")
        )
    return lines


def _source(restart: dict, names: dict) -> str:
    holder = restart.get("resume_holder")
    if restart.get("resume_from") != "snapshot":
        return ""
    return f"{names.get(holder, holder)}'s snapshot (copied to /data) at " if holder else "the nodes' snapshots at "
