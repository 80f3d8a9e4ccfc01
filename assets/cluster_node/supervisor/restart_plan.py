"""After a failed attempt: restart on the healthy nodes of the run's pool, or give up (the decisions that
were clusterops/supervise.py `plan` and `spot`). Pure given the run directory's files: the probes, the
Spot notices, config.json, restarts.json, the checkpoints."""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

from cluster_node.programs import health
from cluster_node.protocol import rundir
from cluster_node.protocol.spec import Batch, RunSpec


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


def lost_work(run: Path, resume_step: Optional[int]) -> str:
    """What a restart from `resume_step` loses, and why: "lost 55 steps since the start: the recipe
    checkpoints every 100 steps"."""
    config = rundir.read_json(run / rundir.CONFIG, {}) or {}
    every, minutes = config.get("checkpoint_every"), config.get("checkpoint_minutes")
    last = last_step(run)
    lost = "no steps" if last is None else f"{max(0, last - (resume_step or 0))} steps"
    since = "the start" if resume_step is None else f"the checkpoint at step {resume_step}"
    bound = f"the recipe checkpoints every {every} steps" if every else "no checkpoint interval known"
    bound += f" or {minutes:g} minutes" if minutes else ""
    return f"lost {lost} since {since}: {bound}"


def rebalance(global_batch: int, ranks: int, max_per_rank: int) -> Optional[tuple[int, int]]:
    """(batch per rank, accumulation) giving `global_batch` over `ranks` with micro-batches of at
    most `max_per_rank`; None when the global batch does not split evenly over the ranks."""
    if global_batch % ranks:
        return None
    share = global_batch // ranks
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


def _batch(run: Path, spec: RunSpec, history: tuple[rundir.Restart, ...]) -> Union[tuple[int, int], str]:
    """(global batch, largest micro-batch) the run keeps, or why there is nothing to resume."""
    config = rundir.read_json(run / rundir.CONFIG, {})
    if not config:
        return "no config.json: the run never started training, nothing to resume"
    if history:
        return history[-1].global_batch, history[0].max_batch_per_gpu
    return config["batch_per_gpu"] * config["grad_accum"] * len(spec.hosts) * spec.slots, config["batch_per_gpu"]


def plan(
    run: Path, spec: RunSpec, kind: rundir.EndKind, reason: str, since: float = 0.0, now: Optional[float] = None
) -> Plan:
    """Restart on the healthy nodes of the pool, the same global batch; after a Spot notice (kind spot)
    the noticed nodes are left out too: they still answer, for two minutes."""
    history = rundir.read_list(run / rundir.RESTARTS, rundir.Restart)
    allowed = spec.limits.max_restarts
    if len(history) >= allowed:
        return Plan(f"restarts exhausted ({len(history)}/{allowed})")
    kept = _batch(run, spec, history)
    if isinstance(kept, str):
        return Plan(kept)
    global_batch, max_per_rank = kept
    verdicts = judge(run, spec.pool, spec.slots)
    if kind == rundir.EndKind.SPOT:
        for host, entry in notices(run, since).items():
            verdicts[host] = [*verdicts.get(host, []), notice_line(entry)]
    healthy = tuple(h for h in spec.pool if not verdicts.get(h))
    dropped = {h: "; ".join(verdicts[h]) for h in spec.pool if verdicts.get(h)}
    named = ", ".join(f"{spec.name(h)} ({why})" for h, why in dropped.items())
    if len(healthy) < spec.limits.min_nodes:
        return Plan(f"{len(healthy)} healthy node(s) left, --min-nodes {spec.limits.min_nodes} (dropped: {named})")
    split = rebalance(global_batch, len(healthy) * spec.slots, max_per_rank)
    if split is None:
        return Plan(f"the global batch {global_batch} does not split evenly over {len(healthy) * spec.slots} ranks")
    record = rundir.Restart(
        time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        kind=kind,
        reason=reason,
        nodes_before=spec.hosts,
        nodes_after=healthy,
        dropped=dropped,
        rejoined=tuple(h for h in healthy if h not in spec.hosts),
        resume_step=last_checkpoint_step(run),
        global_batch=global_batch,
        batch_per_gpu=split[0],
        grad_accum=split[1],
        max_batch_per_gpu=max_per_rank,
        names={h: spec.name(h) for h in spec.pool} if spec.names else None,
    )
    start, lost = resumes_from(record.resume_step), lost_work(run, record.resume_step)
    line = (
        f"restart {len(history) + 1}/{allowed} on {len(healthy)} node(s) {spec.names_of(healthy, ' ')} from {start} "
        f"({lost}); batch {split[0]}/rank x accumulation {split[1]} (global {global_batch})"
        + (f"; dropped {named}" if dropped else "")
    )
    return Plan(line, spec.restart(healthy, Batch(split[0], split[1], global_batch)), record)


def history_lines(restarts: list[dict]) -> list[str]:
    """restarts.json for people: one line per restart, nodes by their inventory names where recorded."""
    lines = []
    for i, r in enumerate(restarts, 1):
        names = r.get("names") or {}
        after, dropped, rejoined = ([names.get(h, h) for h in r[key]] for key in ("nodes_after", "dropped", "rejoined"))
        lines.append(
            f"  restart {i}: {r['time']} {r['kind']}: {r['reason'][:160]}; resumed from "
            f"{resumes_from(r['resume_step'])} on {len(after)} node(s) {' '.join(after)}"
            + (f", dropped {', '.join(dropped)}" if dropped else "")
            + (f", rejoined {', '.join(rejoined)}" if rejoined else "")
        )
    return lines
