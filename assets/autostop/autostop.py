"""Autostop watchdog, one per node (the container's entrypoint starts it and restarts it if it dies).

Every minute it decides whether the cluster is busy -- a training step advanced in the last 15
minutes, a GPU is busy while no run is going (nvidia-smi), a data set is being prepared or staged
(prepare.py keeps a marker fresh under /data/.cluster/busy/), or someone has an interactive SSH
session in a container -- on this node or on any other (nodes share what they see in
/data/.cluster/heartbeat/). It then
  * publishes this node's heartbeat, Busy = 1 or 0, to CloudWatch (namespace GpuCluster/Autostop,
    dimension InstanceId); a CloudWatch alarm per node stops the node when the heartbeat has said
    idle, or nothing at all, for IDLE_MINUTES + 30 minutes: the net for a watchdog that died;
  * stops every instance of the cluster itself once the cluster has been idle for IDLE_MINUTES.
The node role may stop only instances tagged gpu-cluster:name=CLUSTER_NAME.

    CLUSTER_NAME=c IDLE_MINUTES=60 NODE_RANK=0 python autostop.py [--data /data]
    CLUSTER_NAME=c python autostop.py --stop-now     # fab train --then-stop

The region comes from AWS_REGION / AWS_DEFAULT_REGION, else from the instance identity document
(IMDSv2): an SSH session in the container has no AWS variables, and botocore does not ask IMDS.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

# The names every layer shares (assets/contract.py; /workspace/contract.py in the image).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from contract import CLUSTER_TAG, METRIC_NAMESPACE  # noqa: E402

NAMESPACE = METRIC_NAMESPACE  # stacks/nodes.py alarms on it, the role may publish only to it
METRIC = "Busy"
GPU_BUSY_PERCENT = 5.0
STEP_WINDOW_S = 15 * 60  # a step within this is "advancing" (the launcher ends runs stalled for 10 min)
MARKER_FRESH_S = 5 * 60  # prepare.py refreshes its marker every minute
STARTUP_BUSY_SAMPLES = 2  # after a (re)start report busy briefly: the alarm leaves ALARM and re-arms
IMDS_URL = os.environ.get("AUTOSTOP_IMDS_URL", "http://169.254.169.254")
_SESSION = re.compile(rb"^sshd(-session)?: \S+@pts/")


@dataclass(frozen=True)
class Observation:
    """What one node sees at one moment."""

    time: float
    step: Optional[int] = None  # the newest unfinished run's step
    progress_age_s: Optional[float] = None  # seconds since that run's progress.json changed
    gpu_util: Optional[float] = None  # max over GPUs, None without GPUs
    gpu_memory: Optional[float] = None  # % used, max over GPUs (for the dashboard)
    preparing: tuple[str, ...] = ()  # fresh data-preparation markers
    sessions: int = 0  # interactive SSH sessions in this container


@dataclass(frozen=True)
class Sample:
    time: float
    busy: tuple[str, ...]  # reasons the cluster is busy; empty: idle
    step: Optional[int] = None


@dataclass(frozen=True)
class Decision:
    stop: bool
    reason: str


def local_reasons(now: Observation, before: Optional[Observation]) -> list[str]:
    """Why this node is busy; empty when it is idle. CPU load is not a signal: a GPU rank keeps
    about one core busy, 2-4% of a large instance. GPU load counts only when no run is going: a
    hung NCCL collective keeps GPUs at 100% without a step (the launcher ends such a run)."""
    reasons = []
    moved = before is not None and now.step is not None and now.step != before.step
    if moved or (now.progress_age_s is not None and now.progress_age_s <= STEP_WINDOW_S):
        reasons.append(f"training step {now.step} advancing")
    if now.step is None and now.gpu_util is not None and now.gpu_util > GPU_BUSY_PERCENT:
        reasons.append(f"GPU {now.gpu_util:.0f}% busy")
    reasons += [f"preparing data ({what})" for what in now.preparing]
    if now.sessions:
        reasons.append(f"{now.sessions} interactive SSH session(s)")
    return reasons


def decide(samples: Sequence[Sample], idle_minutes: float, now: float) -> Decision:
    """Stop when the samples cover the last idle_minutes and the cluster was busy in none of them."""
    if idle_minutes <= 0:
        return Decision(False, "autostop disabled")
    window_start = now - idle_minutes * 60
    window = [s for s in samples if s.time >= window_start]
    if not samples or samples[0].time > window_start or not window:
        return Decision(False, "not enough history yet")
    busy = [s for s in window if s.busy]
    if busy:
        return Decision(False, "busy: " + "; ".join(busy[-1].busy))
    last = window[-1].step
    run = f"no run, GPUs below {GPU_BUSY_PERCENT:g}%" if last is None else f"step stuck at {last}"
    return Decision(True, f"idle for {idle_minutes:g} min: {run}, no data preparation, no interactive session")


# ---------------------------------------------------------------- what a node sees


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile
        return 0.0


def latest_progress(data_dir: Path, now: float) -> tuple[Optional[int], Optional[float]]:
    """(step, age in seconds) of the newest run's progress.json; (None, None) without a run going."""
    progress = max((data_dir / "runs").glob("*/progress.json"), key=_mtime, default=None)
    if progress is None:
        return None, None
    try:
        values = json.loads(progress.read_text())
        if values.get("ended"):
            return None, None
        return int(values["step"]), max(0.0, now - _mtime(progress))
    except (ValueError, KeyError, TypeError, OSError):
        return None, None


def gpu_readings() -> tuple[Optional[float], Optional[float]]:
    """(utilisation %, memory used %), each the maximum over the GPUs; (None, None) without GPUs."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    rows = [
        [float(v) for v in line.split(",")]
        for line in out.splitlines()
        if line.count(",") == 2 and all(v.strip().replace(".", "", 1).isdigit() for v in line.split(","))
    ]
    if not rows:
        return None, None
    return max(r[0] for r in rows), max(100 * r[1] / r[2] for r in rows if r[2] > 0)


def preparing(data_dir: Path, now: float) -> tuple[str, ...]:
    """Data-preparation markers refreshed in the last MARKER_FRESH_S (a killed prepare.py's goes stale)."""
    found = []
    for marker in sorted((data_dir / ".cluster" / "busy").glob("*.json")):
        try:
            if now - _mtime(marker) <= MARKER_FRESH_S:
                found.append(json.loads(marker.read_text()).get("what", marker.stem))
        except (OSError, ValueError):
            continue
    return tuple(found)


def interactive_sessions(proc: Path = Path("/proc")) -> int:
    """sshd processes serving a terminal ("sshd: root@pts/0"); fab's own commands have no pty."""
    count = 0
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            count += bool(_SESSION.match(cmdline.read_bytes()))
        except OSError:
            continue
    return count


def observe(data_dir: Path, now: float) -> Observation:
    step, age = latest_progress(data_dir, now)
    util, memory = gpu_readings()
    return Observation(
        now,
        step,
        age,
        gpu_util=util,
        gpu_memory=memory,
        preparing=preparing(data_dir, now),
        sessions=interactive_sessions(),
    )


def share(data_dir: Path, rank: str, now: float, reasons: list[str]) -> None:
    """Write this node's own reasons where the other nodes read them (atomically)."""
    folder = data_dir / ".cluster" / "heartbeat"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".node{rank}.json.tmp"
    tmp.write_text(json.dumps({"time": now, "busy": reasons}))
    os.replace(tmp, folder / f"node{rank}.json")


def peer_reasons(data_dir: Path, rank: str, now: float, fresh_s: float) -> list[str]:
    """The other nodes' own reasons, from heartbeats written in the last fresh_s seconds."""
    reasons = []
    for path in sorted((data_dir / ".cluster" / "heartbeat").glob("node*.json")):
        if path.stem == f"node{rank}":
            continue
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if now - float(beat.get("time", 0)) <= fresh_s:
            reasons += [f"{path.stem}: {reason}" for reason in beat.get("busy", [])]
    return reasons


# ---------------------------------------------------------------- AWS


def imds_get(path: str, base: str = IMDS_URL, timeout: float = 2.0) -> bytes:
    """GET an instance-metadata path through IMDSv2 (a session token first, then the path with it).
    Raises OSError (urllib.error.HTTPError for a status such as 404) when there is no answer."""
    token_request = urllib.request.Request(
        f"{base}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"}
    )
    with urllib.request.urlopen(token_request, timeout=timeout) as response:
        token = response.read().decode()
    request = urllib.request.Request(f"{base}{path}", headers={"X-aws-ec2-metadata-token": token})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def instance_identity(base: str = IMDS_URL, timeout: float = 2.0) -> dict:
    """The instance identity document through IMDSv2 (region, instanceId), {} off EC2."""
    try:
        return json.loads(imds_get("/latest/dynamic/instance-identity/document", base, timeout))
    except (OSError, ValueError):
        return {}


def where_am_i(environ: dict, identity: Callable[[], dict] = instance_identity) -> tuple[Optional[str], Optional[str]]:
    """(region, instance id): the environment first, then the instance metadata."""
    region = environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION")
    instance = environ.get("INSTANCE_ID")
    if not region or not instance:
        document = identity()
        region, instance = region or document.get("region"), instance or document.get("instanceId")
    return region, instance


def cluster_instances(ec2, cluster: str, states: Sequence[str] = ("pending", "running")) -> list[str]:
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[
            {"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]},
            {"Name": "instance-state-name", "Values": list(states)},
        ]
    )
    return sorted(i["InstanceId"] for page in pages for r in page["Reservations"] for i in r["Instances"])


def stop_cluster(ec2, cluster: str) -> list[str]:
    """Stop every running instance tagged with the cluster's name; returns their ids."""
    ids = cluster_instances(ec2, cluster)
    if ids:
        ec2.stop_instances(InstanceIds=ids)
    return ids


def publish(cloudwatch, instance_id: str, busy: bool, seen: Optional[Observation] = None) -> None:
    """The heartbeat (the alarm's metric) and, on GPU nodes, GPU utilisation and memory for the dashboard."""
    dimensions = [{"Name": "InstanceId", "Value": instance_id}]
    data = [{"MetricName": METRIC, "Dimensions": dimensions, "Value": 1.0 if busy else 0.0, "Unit": "Count"}]
    gpu = (("GPUUtilization", seen.gpu_util), ("GPUMemoryUsedPercent", seen.gpu_memory)) if seen else ()
    for name, value in gpu:
        if value is not None:
            data.append({"MetricName": name, "Dimensions": dimensions, "Value": float(value), "Unit": "Percent"})
    cloudwatch.put_metric_data(Namespace=NAMESPACE, MetricData=data)


# ---------------------------------------------------------------- the loop


def log(message: str, data_dir: Optional[Path] = None) -> None:
    line = f"{time.strftime('%FT%TZ', time.gmtime())} autostop: {message}"
    print(line, flush=True)
    if data_dir is not None:
        with open(data_dir / ".cluster" / "autostop.log", "a") as handle:
            handle.write(line + "\n")


class Watchdog:
    """The decision, one observation at a time: tick() returns this minute's reasons (the
    heartbeat is busy when there are any) and whether to stop the cluster now."""

    def __init__(self, idle_minutes: float, interval: float):
        self.idle, self.interval = idle_minutes, interval
        self.samples: list[Sample] = []
        self.before: Optional[Observation] = None

    def tick(self, seen: Observation, peers: Sequence[str] = ()) -> tuple[list[str], Decision]:
        reasons = local_reasons(seen, self.before) + list(peers)
        if len(self.samples) < STARTUP_BUSY_SAMPLES:
            reasons.append("watchdog starting")
        self.samples.append(Sample(seen.time, tuple(reasons), seen.step))
        self.samples = [s for s in self.samples if s.time >= seen.time - self.idle * 60 - 2 * self.interval]
        self.before = seen
        return reasons, decide(self.samples, self.idle, seen.time)


def watch(data_dir: Path, rank: str, idle: float, interval: float, ec2, cloudwatch, instance_id: Optional[str]) -> int:
    dog, state = Watchdog(idle, interval), None
    while True:
        now = time.time()
        seen = observe(data_dir, now)
        share(data_dir, rank, now, local_reasons(seen, dog.before))
        reasons, decision = dog.tick(seen, peer_reasons(data_dir, rank, now, fresh_s=3 * interval))
        if instance_id:
            try:
                publish(cloudwatch, instance_id, bool(reasons), seen)
            except Exception as error:  # noqa: BLE001 - a missed beat counts as idle; keep watching
                log(f"heartbeat not published: {error}")
        if bool(reasons) != state:
            state = bool(reasons)
            log("busy: " + "; ".join(reasons) if reasons else "idle")
        if decision.stop:
            log(f"{decision.reason}; stopping {stop_cluster(ec2, os.environ['CLUSTER_NAME'])}", data_dir)
            return 0
        time.sleep(max(0.0, interval - (time.time() - now)))


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="/data")
    parser.add_argument("--interval", type=float, default=60.0, help="seconds between heartbeats (alarm period: 60)")
    parser.add_argument("--stop-now", action="store_true", help="stop the cluster now (fab train --then-stop)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    cluster, idle = os.environ.get("CLUSTER_NAME"), float(os.environ.get("IDLE_MINUTES", "0"))
    if not cluster or (idle <= 0 and not args.stop_now):
        print("autostop: off (CLUSTER_NAME unset or IDLE_MINUTES=0); nothing stopped", flush=True)
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
        print(f"autostop: run ended; stopping {stop_cluster(ec2, cluster)}", flush=True)
        return 0
    if not instance_id:
        log("no instance id (INSTANCE_ID unset, no instance metadata): heartbeat not published")
    return watch(
        Path(args.data),
        os.environ.get("NODE_RANK", "0"),
        idle,
        args.interval,
        ec2,
        boto3.client("cloudwatch", region_name=region),
        instance_id,
    )


if __name__ == "__main__":
    sys.exit(main())
