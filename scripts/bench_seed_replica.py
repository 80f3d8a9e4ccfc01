#!/usr/bin/env python3
"""The seeds' situation on the emulated cluster: transformer-base (full architecture, numbers
vocabulary) at a small batch on 2 nodes whose links are capped (1 Gbit), for every gradient
compression mode, against the 1-node no-communication bound measured in the same run.

    flock /work/helpers/cluster.lock .venv/bin/python scripts/bench_seed_replica.py [--steps 12]

Brings up its own cluster (--name, default seedrep) and takes it down at the end. Step times
are the trainer's summary.json means (its first steps are skipped there); the exposed share and the
payload come from the summary's breakdown.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

from clusterops import localcluster

REPO = Path(__file__).resolve().parent.parent

MODES = ("none", "fp16", "bf16", "powersgd")
QUIET = "--eval-every 100000 --eval-samples 1 --checkpoint-every 100000 --log-every 4 --dropout 0"


def fab(env: dict, *args: str) -> str:
    result = subprocess.run(["fab", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise SystemExit(f"fab {shlex.join(args)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return result.stdout


def measure(env: dict, shared: Path, run: str, nodes: int, mode: str, args, bucket_mb: float = 25.0) -> dict:
    """One short run; its summary (step time, breakdown)."""
    fab(
        env,
        *("train", "--run", run, "--recipe", "transformer-base", "--dataset", "numbers", "--nodes", str(nodes)),
        *("--steps", str(args.steps), "--batch-per-gpu", str(args.batch), "--grad-compression", mode),
        *("--follow", "--extra", f"{QUIET} --bucket-cap-mb {bucket_mb:g}"),
    )
    return json.loads((shared / "runs" / run / "summary.json").read_text())


def row(name: str, summary: dict, bound_s: float) -> str:
    step = summary["avg_step_time_s"]
    b = summary.get("breakdown", {})
    share = b.get("comm_exposed_s", 0.0) / b["step_s"] if b.get("step_s") else 0.0
    return (
        f"{name:<16} {step * 1000:>8.0f} {step / bound_s:>7.2f}x {share:>8.0%} "
        f"{b.get('payload_bytes', 0) / 1e6:>10.1f} {b.get('buckets', 0):>8.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--name", default="seedrep")
    parser.add_argument("--subnet", default="10.213.60.0/24")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--bucket-caps", default="25", help="DDP bucket sizes in MB to try per mode, e.g. 5,25,100")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GPU_CLUSTER_INVENTORY=f"{tmp}/inv.json")
        env["PATH"] = f"{REPO / '.venv' / 'bin'}:{env.get('PATH', '')}"
        shared = localcluster.STATE_ROOT / args.name / "shared"
        fab(
            env,
            "local.up",
            "--nodes",
            "2",
            "--link",
            args.link,
            "--name",
            args.name,
            "--subnet",
            args.subnet,
            "--replace",
        )
        try:
            fab(env, "data", "--extra", "--train 20000 --valid 100 --test 50")
            bound = measure(env, shared, "bound-1node", 1, "none", args)
            caps = [float(cap) for cap in args.bucket_caps.split(",")]
            results = [
                (
                    mode if len(caps) == 1 else f"{mode} {cap:g} MB",
                    measure(env, shared, f"seed-{mode}-{cap:g}", 2, mode, args, cap),
                )
                for mode in args.modes.split(",")
                for cap in caps
            ]
        finally:
            fab(env, "local.down", "--name", args.name, "--yes")  # a benchmark keeps no run
    bound_s = bound["avg_step_time_s"]
    print(f"transformer-base, batch {args.batch}/rank, {args.steps} steps, 2 nodes at {args.link}")
    print(f"{'mode':<16} {'ms/step':>8} {'x bound':>8} {'exposed':>8} {'payload MB':>10} {'buckets':>8}")
    print(row("1 node (bound)", bound, bound_s))
    for mode, summary in results:
        print(row(mode, summary, bound_s))
    best = min(results, key=lambda r: r[1]["avg_step_time_s"])
    print(f"best: {best[0]} at {best[1]['avg_step_time_s'] / bound_s:.2f}x the bound (goal <= 1.25x)")


if __name__ == "__main__":
    main()
