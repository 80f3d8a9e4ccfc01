"""Autostop watchdog, one per node (the container's entrypoint starts it and restarts it if it dies).

Every minute it decides whether the cluster is busy -- a training step advanced in the last 15
minutes, a launched run has not reached its first step yet, a GPU is busy or holds a process, a data
set is being prepared, a terminal had input or an SSH connection carried traffic in the last 30
minutes (cluster_node/daemons/autostop/busy_signals.py says each) -- on this node or on any other (nodes share what
they see in /data/.cluster/heartbeat/). It then
  * publishes this node's heartbeat, Busy = 1 or 0, to CloudWatch (namespace GpuCluster/Autostop,
    dimension InstanceId); a CloudWatch alarm per node stops the node when the heartbeat has said
    idle, or nothing at all, for IDLE_MINUTES + 30 minutes: the net for a watchdog that died. With
    IDLE_MINUTES 0 (autostop off, no alarm) it runs all the same and says busy: idle_minutes is read
    again from its SSM parameter every 5 minutes, and an alarm created by a change to N finds beats;
  * stops every instance of the cluster itself once the cluster has been idle for IDLE_MINUTES. A
    stop that fails is logged and retried, further apart each time; the heartbeat keeps saying idle.
The idle clock is kept on /data (cluster_node/daemons/autostop/idle_state.py): a restarted watchdog resumes it.
The node role may stop only instances tagged gpu-cluster:name=CLUSTER_NAME.

    CLUSTER_NAME=c IDLE_MINUTES=60 NODE_RANK=0 python -m cluster_node.daemons.autostop.watchdog [--data /data]
    CLUSTER_NAME=c python -m cluster_node.daemons.autostop.watchdog --stop-now     # fab train --then-stop

The region comes from AWS_REGION / AWS_DEFAULT_REGION, else from the instance identity document
(IMDSv2): an SSH session in the container has no AWS variables, and botocore does not ask IMDS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from cluster_node.daemons.autostop import busy_signals as signals
from cluster_node.daemons.autostop import idle_state
from cluster_node.daemons.autostop.busy_signals import GPU_BUSY_PERCENT, STEP_WINDOW_S
from cluster_node.daemons.autostop.cloud import (
    IDLE_REFRESH_S,
    IdleLimit,
    bootstrapping,
    cluster_instances,
    publish,
    refusal_hint,
    stop_cluster,
    stop_each,
)
from cluster_node.daemons.imds import instance_identity
from cluster_node.protocol import clusterdir
from cluster_node.protocol.contract import (
    BUSY_METRIC,
    CONTAINER_SSH_PORT,
    FAB_SSH_MARKS,
    METRIC_NAMESPACE,
    idle_minutes_parameter,
)

NAMESPACE = METRIC_NAMESPACE  # stacks/nodes.py alarms on it, the role may publish only to it
METRIC = BUSY_METRIC
STARTUP_BUSY_SAMPLES = 2  # after a boot report busy briefly: the alarm leaves ALARM and re-arms
RETRY_FIRST_S, RETRY_MAX_S = 60.0, 30 * 60.0  # a refused stop: again after 1, 2, 4 ... 30 min
# Terminals and SSH connections alone keep the cluster up this long at most (a forgotten session, a
# tool that polls): then they count as idle until training, GPU work or data preparation.
INTERACTIVE_MAX_S = 3 * 3600.0


@dataclass(frozen=True)
class Observation:
    """What one node sees at one moment."""

    time: float
    step: Optional[int] = None  # the newest unfinished run's step
    progress_age_s: Optional[float] = None  # seconds since that run's progress.json changed
    gpu_util: Optional[float] = None  # max over GPUs, None without GPUs
    gpu_memory: Optional[float] = None  # % used, max over GPUs (for the dashboard)
    preparing: tuple[str, ...] = ()  # fresh data-preparation markers
    run_live: bool = False  # runs/.active names a run its launcher is running
    launching: Optional[str] = None  # that run has no step yet, within the launcher's start limit
    gpu_processes: int = 0  # processes on a GPU that was busy (or they appeared) in the last 30 min
    terminals: tuple[str, ...] = ()  # terminals with input in the last 30 min
    connections: tuple[str, ...] = ()  # SSH connections with traffic in the last 30 min


@dataclass(frozen=True)
class Decision:
    stop: bool
    reason: str


def local_reasons(now: Observation, before: Optional[Observation]) -> list[str]:
    """Why this node is busy; empty when it is idle. CPU load is not a signal: a GPU rank keeps
    about one core busy, 2-4% of a large instance. GPU load and GPU processes count whether or not a
    run is marked, except while a marked run's step is stuck: a hung NCCL collective keeps GPUs at
    100% without a step (the launcher ends such a run)."""
    reasons = []
    moved = before is not None and now.step is not None and now.step != before.step
    advancing = moved or (now.progress_age_s is not None and now.progress_age_s <= STEP_WINDOW_S)
    if advancing:
        reasons.append(f"training step {now.step} advancing")
    if now.launching:
        reasons.append(now.launching)
    hung = now.run_live and now.step is not None and not advancing
    if not hung and now.gpu_util is not None and now.gpu_util > GPU_BUSY_PERCENT:
        reasons.append(f"GPU {now.gpu_util:.0f}% busy")
    if not hung and now.gpu_processes:
        reasons.append(f"{now.gpu_processes} GPU process(es)")
    reasons += [f"preparing data ({what})" for what in now.preparing]
    return reasons + list(now.terminals) + list(now.connections)


def decide(state: Optional[idle_state.IdleState], idle_minutes: float, now: float) -> Decision:
    """Stop when the watch covers the last idle_minutes and the cluster was busy at no sample of them."""
    if idle_minutes <= 0:
        return Decision(False, "autostop disabled")
    if state is None or state.since > now - idle_minutes * 60:
        return Decision(False, "not enough history yet")
    if state.busy_at is not None and state.busy_at >= now - idle_minutes * 60:
        return Decision(False, "busy: " + "; ".join(state.busy))
    last = state.step
    run = f"no run, GPUs below {GPU_BUSY_PERCENT:g}%" if last is None else f"step stuck at {last}"
    return Decision(True, f"idle for {idle_minutes:g} min: {run}, no data preparation, no interactive session")


# ---------------------------------------------------------------- what a node sees


@dataclass(frozen=True)
class Sources:
    """Where a node looks for interactive use (tests point these elsewhere)."""

    pts: Path = Path("/dev/pts")
    ssh_port: int = CONTAINER_SSH_PORT
    fab_marks: Path = Path(FAB_SSH_MARKS)  # connections fab marked as its own (not use)


def observe(
    data_dir: Path, now: float, sources: Optional[Sources] = None, memory: Optional[dict] = None
) -> Observation:
    """This node's signals (cluster_node/daemons/autostop/busy_signals.py). memory: what the signals with a memory
    (SSH byte counters, GPU processes) kept from the previous call; updated in place."""
    sources, memory = sources or Sources(), memory if memory is not None else {}
    step, age = signals.latest_progress(data_dir, now)
    live, launching = signals.launched_run(data_dir, now)
    util, gpu_memory = signals.gpu_readings()
    processes, memory["gpu"] = signals.gpu_activity(now, signals.gpu_processes(), util, memory.get("gpu", {}))
    readings = signals.ssh_connections(sources.ssh_port)
    fab = signals.fab_connections(sources.fab_marks, readings)
    connections, memory["connections"] = signals.connection_activity(
        now, {k: v for k, v in readings.items() if k not in fab}, memory.get("connections", {})
    )
    return Observation(
        now,
        step,
        age,
        gpu_util=util,
        gpu_memory=gpu_memory,
        preparing=signals.preparing(data_dir, now),
        run_live=live,
        launching=launching,
        gpu_processes=processes,
        terminals=signals.terminals(now, sources.pts),
        connections=connections,
    )


def share(data_dir: Path, rank: str, now: float, reasons: list[str]) -> None:
    """Write this node's own reasons where the other nodes read them (atomically)."""
    path = clusterdir.node_json(data_dir, clusterdir.HEARTBEAT_DIR, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"time": now, "busy": reasons}))
    os.replace(tmp, path)


def peer_reasons(data_dir: Path, rank: str, now: float, fresh_s: float) -> list[str]:
    """The other nodes' own reasons, from heartbeats written in the last fresh_s seconds."""
    reasons = []
    folder = clusterdir.node_json(data_dir, clusterdir.HEARTBEAT_DIR, rank).parent
    for path in sorted(folder.glob(clusterdir.NODE_JSON.format(rank="*"))):
        if path.name == clusterdir.NODE_JSON.format(rank=rank):
            continue
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if now - float(beat.get("time", 0)) <= fresh_s:
            reasons += [f"{path.stem}: {reason}" for reason in beat.get("busy", [])]
    return reasons


# ---------------------------------------------------------------- AWS


def where_am_i(environ: dict, identity: Callable[[], dict] = instance_identity) -> tuple[Optional[str], Optional[str]]:
    """(region, instance id): the environment first, then the instance metadata."""
    region = environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION")
    instance = environ.get("INSTANCE_ID")
    if not region or not instance:
        document = identity()
        region, instance = region or document.get("region"), instance or document.get("instanceId")
    return region, instance


# ---------------------------------------------------------------- the loop


def log(message: str, data_dir: Optional[Path] = None) -> None:
    line = f"{time.strftime('%FT%TZ', time.gmtime())} autostop: {message}"
    print(line, flush=True)
    if data_dir is not None:
        with open(data_dir / clusterdir.CLUSTER / clusterdir.AUTOSTOP_LOG, "a") as handle:
            handle.write(line + "\n")


class Watchdog:
    """The decision, one observation at a time: tick() returns this minute's reasons (the heartbeat
    is busy when there are any) and whether to stop the cluster now. With a path, the idle clock is
    loaded from it (when this boot's) and saved at every tick."""

    def __init__(
        self,
        idle_minutes: float,
        interval: float,
        path: Optional[Path] = None,
        boot: str = "",
        interactive_max_s: float = INTERACTIVE_MAX_S,
    ):
        self.idle, self.interval, self.path, self.boot = idle_minutes, interval, path, boot
        self.interactive_max_s, self.capped = interactive_max_s, False
        self.state = idle_state.load(path, boot) if path else None
        self.memory: dict = self.state.memory if self.state else {}
        # Resumed: no startup beats (the alarm is armed, the clock goes on); a new boot: as before.
        self.starting = 0 if self.state else STARTUP_BUSY_SAMPLES
        self.before = Observation(self.state.last, self.state.step) if self.state else None

    def tick(self, seen: Observation, peers: Sequence[str] = ()) -> tuple[list[str], Decision]:
        reasons = local_reasons(seen, self.before) + list(peers)
        if self.starting:
            self.starting -= 1
            reasons.append("watchdog starting")
        if self.state is None:
            self.state = idle_state.IdleState(self.boot, since=seen.time, last=seen.time, memory=self.memory)
        reasons = self.cap_interactive(seen.time, reasons)
        self.state.record(seen.time, reasons, seen.step)
        self.before = seen
        self.save()
        return reasons, decide(self.state, self.idle, seen.time)

    def cap_interactive(self, now: float, reasons: list[str]) -> list[str]:
        """Terminals and SSH connections alone (no training, GPU work, data preparation) count for
        interactive_max_s at most; then they count as idle until other work, or a moment with no
        use at all, starts the count again."""
        assert self.state is not None
        if not reasons or not all(signals.interactive(r) for r in reasons):
            self.state.interactive_since, self.capped = None, False
            return reasons
        since = self.state.interactive_since = self.state.interactive_since or now
        if now - since <= self.interactive_max_s:
            return reasons
        if not self.capped:
            self.capped = True
            log(f"only interactive use for {self.interactive_max_s / 60:g} min: it counts as idle until other work")
        return []

    def save(self) -> None:
        if self.path is None or self.state is None:
            return
        try:
            idle_state.save(self.path, self.state)
        except OSError as error:  # /data unreachable: keep the clock in memory, keep watching
            log(f"idle clock not saved to {self.path}: {error}")


class Loop:
    """One round a minute: observe, share, decide, publish the heartbeat, stop (or retry a refused
    stop, further apart each time, without touching the idle clock)."""

    def __init__(
        self, data_dir: Path, rank: str, dog: Watchdog, ec2, cloudwatch, instance_id, cluster, sources, limit=None
    ):
        self.data, self.rank, self.dog, self.ec2, self.cloudwatch = data_dir, rank, dog, ec2, cloudwatch
        self.instance_id, self.cluster, self.sources = instance_id, cluster, sources
        self.limit: Optional[IdleLimit] = limit
        self.said: Optional[bool] = None
        self.holding: list[str] = []
        # Asked again each round until it answers: without an id no heartbeat goes out, and the node's alarm
        # (missing data counts as idle) would stop it, busy or not, idle_minutes + 30 min after its boot.
        self.identify: Callable[[], Optional[str]] = lambda: None

    def apply_limit(self, now: float) -> None:
        """idle_minutes as its parameter says now; switched on (from 0), the idle clock starts now."""
        value = self.limit.current(now) if self.limit else self.dog.idle
        if self.dog.idle <= 0 < value and self.dog.state is not None:
            self.dog.state.since, self.dog.state.busy_at = now, None
        self.dog.idle = value

    def round(self, now: float) -> Optional[int]:
        """One round; an exit code once the cluster has been stopped."""
        self.apply_limit(now)
        seen = observe(self.data, now, self.sources, self.dog.memory)
        share(self.data, self.rank, now, local_reasons(seen, self.dog.before))
        reasons, decision = self.dog.tick(seen, peer_reasons(self.data, self.rank, now, fresh_s=3 * self.dog.interval))
        self.instance_id = self.instance_id or self.identify()
        if self.instance_id:
            try:  # autostop off (idle_minutes 0): busy beats, so an alarm created with a new value waits
                publish(self.cloudwatch, self.instance_id, bool(reasons) or self.dog.idle <= 0, seen)
            except Exception as error:  # noqa: BLE001 - a missed beat counts as idle; keep watching
                log(f"heartbeat not published: {error}")
        if bool(reasons) != self.said:
            self.said = bool(reasons)
            log("busy: " + "; ".join(reasons) if reasons else "idle")
        state = self.dog.state
        if not decision.stop or state is None or now < state.retry_at or self.held(now):
            return None
        try:
            ids = stop_cluster(self.ec2, self.cluster, own=self.instance_id)
        except Exception as error:  # noqa: BLE001 - a refused stop must not end the watch (issue 19 §14)
            state.stop_failures += 1
            delay = min(self.dog.interval * 2 ** (state.stop_failures - 1), 30 * self.dog.interval)
            state.retry_at = now + delay
            self.dog.save()
            log(f"{decision.reason}; stop refused ({error}); retrying in {delay:g} s{refusal_hint(error)}", self.data)
            return None
        log(f"{decision.reason}; stopping {ids}", self.data)
        return 0

    def held(self, now: float) -> bool:
        """An idle cluster's stop waits while a deploy bootstraps a node (cloud.bootstrapping); said once."""
        try:
            new = bootstrapping(self.ec2, self.cluster, clusterdir.ready_instances(self.data), now)
        except Exception as error:  # noqa: BLE001 - unknown: stop as before
            log(f"could not look for bootstrapping nodes: {error}")
            return False
        if new and new != self.holding:
            log(f"idle, but not stopping: {', '.join(new)} still bootstrapping (a deploy is under way)", self.data)
        self.holding = new
        return bool(new)


def stop_now(ec2, cluster: str, own: Optional[str] = None) -> int:
    """--stop-now (fab train --then-stop): every node's outcome on its own line, this node's (`own`) stopped
    last; 1 when one still runs."""
    ids = cluster_instances(ec2, cluster)
    outcome = stop_each(ec2, ids, own=own)
    for instance in ids:
        print(f"autostop: {instance}: {outcome[instance]}", flush=True)
    stopping = [i for i in ids if outcome[i] == "stopping"]
    print(f"autostop: run ended; stopping {stopping}", flush=True)
    return 0 if len(stopping) == len(ids) else 1


def watch(loop: Loop, interval: float) -> int:
    while True:
        now = time.time()
        code = loop.round(now)
        if code is not None:
            return code
        time.sleep(max(0.0, interval - (time.time() - now)))


def idle_minutes(environ: dict) -> float:
    """The idle limit the container was created with: IDLE_MINUTES (0: autostop off); the parameter
    (cloud.IdleLimit) says what it is now."""
    return float(environ.get("IDLE_MINUTES", "0"))


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="/data")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between heartbeats (alarm period: 60)")
    parser.add_argument("--stop-now", action="store_true", help="stop the cluster now (fab train --then-stop)")
    parser.add_argument("--pts", default="/dev/pts", help="where the terminals are (tests point elsewhere)")
    parser.add_argument("--ssh-port", type=int, default=CONTAINER_SSH_PORT, help="the container's sshd")
    parser.add_argument("--fab-marks", default=FAB_SSH_MARKS, help="where fab marks its own SSH connections")
    parser.add_argument("--refresh", type=float, default=IDLE_REFRESH_S, help="seconds between idle_minutes reads")
    parser.add_argument(
        "--interactive-max-minutes",
        type=float,
        default=float(os.environ.get("INTERACTIVE_MAX_MINUTES", INTERACTIVE_MAX_S / 60)),
        help="interactive use alone counts this long at most (default 180)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    cluster, idle = os.environ.get("CLUSTER_NAME"), idle_minutes(dict(os.environ))
    if not cluster:
        print("autostop: off (CLUSTER_NAME unset); nothing stopped", flush=True)
        return 2 if args.stop_now else 0
    region, instance_id = where_am_i(dict(os.environ))
    if not region:
        print(
            "autostop: no AWS region (AWS_REGION unset and no instance metadata); nothing stopped",
            file=sys.stderr,
            flush=True,
        )
        return 2
    import boto3

    ec2 = boto3.client("ec2", region_name=region)
    if args.stop_now:
        return stop_now(ec2, cluster, instance_id)
    if not instance_id:
        log("no instance id (INSTANCE_ID unset, no instance metadata yet): no heartbeat until it answers")
    data, rank = Path(args.data), os.environ.get("NODE_RANK", "0")
    path, boot = idle_state.state_path(data, rank), idle_state.boot_id()
    dog = Watchdog(idle, args.interval, path, boot, interactive_max_s=args.interactive_max_minutes * 60)
    cloudwatch = boto3.client("cloudwatch", region_name=region)
    sources = Sources(Path(args.pts), args.ssh_port, Path(args.fab_marks))
    limit = IdleLimit(boto3.client("ssm", region_name=region), idle_minutes_parameter(cluster), idle, args.refresh, log)
    loop = Loop(data, rank, dog, ec2, cloudwatch, instance_id, cluster, sources, limit)
    loop.identify = lambda: where_am_i(dict(os.environ))[1]
    return watch(loop, args.interval)


if __name__ == "__main__":
    sys.exit(main())
