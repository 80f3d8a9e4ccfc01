"""Autostop watchdog (head node): stops every instance of this cluster when no training step has
advanced and the GPUs have been idle for IDLE_MINUTES. The instance role may stop only instances
tagged gpu-cluster:name=CLUSTER_NAME. A CloudWatch alarm per node is the safety net if this dies.

    CLUSTER_NAME=c IDLE_MINUTES=60 AWS_REGION=us-east-1 python autostop.py [--data /data]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

CLUSTER_TAG = "gpu-cluster:name"
GPU_IDLE_PERCENT = 5.0


@dataclass(frozen=True)
class Sample:
    time: float
    step: Optional[int]          # the newest run's step, None when there is no run
    gpu_util: Optional[float]    # max over GPUs, None without GPUs


@dataclass(frozen=True)
class Decision:
    stop: bool
    reason: str


def decide(samples: Sequence[Sample], idle_minutes: float, now: float) -> Decision:
    """Stop when the samples cover the last idle_minutes, the step did not advance in them, and
    no GPU was busy in them."""
    if idle_minutes <= 0:
        return Decision(False, "autostop disabled")
    window_start = now - idle_minutes * 60
    window = [s for s in samples if s.time >= window_start]
    if not samples or samples[0].time > window_start or not window:
        return Decision(False, "not enough history yet")
    steps = {s.step for s in window}
    if len(steps) > 1:
        return Decision(False, "training steps are advancing")
    busy = [s.gpu_util for s in window if s.gpu_util is not None and s.gpu_util > GPU_IDLE_PERCENT]
    if busy:
        return Decision(False, f"GPUs busy (up to {max(busy):.0f}%)")
    step = steps.pop()
    what = "no run" if step is None else f"step stuck at {step}"
    return Decision(True, f"idle for {idle_minutes:g} min: {what}, GPUs below {GPU_IDLE_PERCENT:g}%")


def latest_step(data_dir: Path) -> Optional[int]:
    progress = sorted((data_dir / "runs").glob("*/progress.json"), key=lambda p: p.stat().st_mtime)
    if not progress:
        return None
    try:
        return int(json.loads(progress[-1].read_text())["step"])
    except (ValueError, KeyError, OSError):
        return None


def gpu_utilisation() -> Optional[float]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    values = [float(v) for v in out.split()]
    return max(values) if values else None


def cluster_instances(ec2, cluster: str, states: Sequence[str] = ("pending", "running")) -> list[str]:
    pages = ec2.get_paginator("describe_instances").paginate(Filters=[
        {"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]},
        {"Name": "instance-state-name", "Values": list(states)}])
    return sorted(i["InstanceId"] for page in pages for r in page["Reservations"] for i in r["Instances"])


def stop_cluster(ec2, cluster: str) -> list[str]:
    """Stop every running instance tagged with the cluster's name; returns their ids."""
    ids = cluster_instances(ec2, cluster)
    if ids:
        ec2.stop_instances(InstanceIds=ids)
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="/data")
    parser.add_argument("--interval", type=float, default=60.0)
    parser.add_argument("--stop-now", action="store_true", help="stop the cluster now (fab train --then-stop)")
    args = parser.parse_args(argv)
    cluster, idle = os.environ.get("CLUSTER_NAME"), float(os.environ.get("IDLE_MINUTES", "0"))
    if args.stop_now:
        if not cluster:
            print("autostop: CLUSTER_NAME is not set; nothing stopped", file=sys.stderr)
            return 2
        import boto3
        print(f"autostop: run ended; stopping {stop_cluster(boto3.client('ec2'), cluster)}", flush=True)
        return 0
    if not cluster or idle <= 0:
        print("autostop: off (CLUSTER_NAME unset or IDLE_MINUTES=0)", flush=True)
        return 0
    import boto3
    ec2 = boto3.client("ec2")
    samples: list[Sample] = []
    log = Path(args.data) / ".cluster" / "autostop.log"
    while True:
        now = time.time()
        samples.append(Sample(now, latest_step(Path(args.data)), gpu_utilisation()))
        samples = [s for s in samples if s.time >= now - idle * 60 - 2 * args.interval]
        decision = decide(samples, idle, now)
        if decision.stop:
            ids = stop_cluster(ec2, cluster)
            message = f"{time.strftime('%FT%TZ', time.gmtime())} autostop: {decision.reason}; stopping {ids}"
            print(message, flush=True)
            with open(log, "a") as handle:
                handle.write(message + "\n")
            return 0
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
