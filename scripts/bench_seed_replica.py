#!/usr/bin/env python3
"""The seeds' situation on the emulated cluster: transformer-base (full architecture, numbers
vocabulary) at a small batch on 2 nodes whose links are capped (1 Gbit), for every gradient
compression mode, against the 1-node no-communication bound measured in the same run.

    .venv/bin/python scripts/bench_seed_replica.py [--steps 12] [--save seed.json]

Needs root. Brings up its own cluster (--name, default seedrep) and takes it down at the end; it
holds the machine's one-cluster lock meanwhile (clusterops/local/lock.py: /tmp/emulated-cluster.lock
or GPU_CLUSTER_LOCK) and refuses in one line when another run holds it (--wait-lock waits). Step
times are the trainer's summary.json means (its first steps are skipped there); the exposed share
and the payload come from the summary's breakdown. Last, the step model's what-ifs from the `none`
run (its breakdown and the link `fab check` measured, as `fab report` takes them) against each mode's
measured step: the model's error here.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

from cluster_node.protocol import clusterdir, rundir
from clusterops.local import cluster as localcluster
from clusterops.local import lock as onecluster
from clusterops.predict import bottleneck
from clusterops.run import analysis

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
    return json.loads((rundir.run_dir(shared, run) / rundir.SUMMARY).read_text())


def row(name: str, summary: dict, bound_s: float) -> str:
    step = summary["avg_step_time_s"]
    b = summary.get("breakdown", {})
    share = b.get("comm_exposed_s", 0.0) / b["step_s"] if b.get("step_s") else 0.0
    return (
        f"{name:<16} {step * 1000:>8.0f} {step / bound_s:>7.2f}x {share:>8.0%} "
        f"{b.get('payload_bytes', 0) / 1e6:>10.1f} {b.get('buckets', 0):>8.0f}"
    )


def model_errors(results: list, link_gbit: float) -> list[str]:
    """Each compression mode's step as predicted from the `none` run's breakdown, against its own."""
    measured = {name: summary for name, summary in results}
    if "none" not in measured or not measured["none"].get("breakdown"):
        return ["no `none` run: no predictions to score"]
    base = bottleneck.Breakdown.from_summary(measured["none"])
    predicted = {p.name.split()[0]: p for p in bottleneck.what_ifs(base, link_gbit)}
    lines = [f"{'mode':<10} {'predicted':>9} {'measured':>9} {'ratio':>6}  model"]
    for mode, summary in measured.items():
        if mode != "none" and mode in predicted:
            step = summary["avg_step_time_s"]
            p = predicted[mode]
            lines.append(f"{mode:<10} {p.step_s * 1000:>9.0f} {step * 1000:>9.0f} {p.step_s / step:>6.2f}  {p.model}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--name", default="seedrep")
    parser.add_argument("--subnet", default="10.213.60.0/24")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--bucket-caps", default="25", help="DDP bucket sizes in MB to try per mode, e.g. 5,25,100")
    parser.add_argument("--save", help=f"write every run's {rundir.SUMMARY} into this JSON file")
    parser.add_argument("--wait-lock", action="store_true", help="wait for another emulated cluster run to end")
    args = parser.parse_args()
    try:
        with onecluster.held(wait=args.wait_lock):
            bound, results, link = run_all(args)
    except onecluster.ClusterBusy as busy:
        raise SystemExit(str(busy)) from None
    if args.save:
        saved = {"bound": bound, "runs": results, "link": args.link, "link_json": link}
        Path(args.save).write_text(json.dumps(saved, indent=2))
    bound_s = bound["avg_step_time_s"]
    print(f"transformer-base, batch {args.batch}/rank, {args.steps} steps, 2 nodes at {args.link}")
    print(f"{'mode':<16} {'ms/step':>8} {'x bound':>8} {'exposed':>8} {'payload MB':>10} {'buckets':>8}")
    print(row("1 node (bound)", bound, bound_s))
    for mode, summary in results:
        print(row(mode, summary, bound_s))
    best = min(results, key=lambda r: r[1]["avg_step_time_s"])
    print(f"best: {best[0]} at {best[1]['avg_step_time_s'] / bound_s:.2f}x the bound (goal <= 1.25x)")
    rate = bottleneck.link_rate(link) or analysis.tc_rate_gbit(args.link) or 1.0
    print(f"predicted from the none run at the link fab check measured: {rate:.3f} Gbit/s (cap {args.link})")
    print("\n".join(model_errors(results, rate)))


def run_all(args) -> tuple[dict, list, dict]:
    """Up, data, the link measured (`fab check`), the 1-node bound and every mode (x bucket cap) on 2
    nodes, down."""
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
            fab(env, "check")
            link = json.loads((shared / clusterdir.CLUSTER / clusterdir.LINK_JSON).read_text())
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
    return bound, results, link


if __name__ == "__main__":
    main()
