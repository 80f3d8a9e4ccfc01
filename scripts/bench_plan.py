#!/usr/bin/env python3
"""`fab plan`'s time predictions against runs on the emulated cluster: one run per node count
(1, 2, 3) at the same global batch, each count predicted from the 1-node run and from the 2-node
run; the error is predicted / measured - 1 (issue 22: within 20%).

    .venv/bin/python scripts/bench_plan.py [--steps 30] [--batch 12] [--link 1gbit]

Needs root. Brings up its own 3-node cluster (--name, default planb) and takes it down at the
end, holding the machine's one-cluster lock meanwhile (clusterops/local/lock.py; --wait-lock waits).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

from cluster_node.protocol import rundir
from clusterops.local import cluster as localcluster
from clusterops.local import lock as onecluster
from clusterops.predict import plan as planning
from clusterops.run import analysis

REPO = Path(__file__).resolve().parent.parent
QUIET = "--eval-every 100000 --eval-samples 1 --checkpoint-every 100000 --log-every 10"


def fab(env: dict, *args: str, check: bool = True) -> str:
    result = subprocess.run(["fab", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0 and not check:
        return f"fab {' '.join(args)} failed: {result.stdout[-2000:]}{result.stderr[-2000:]}"
    if result.returncode != 0:
        raise SystemExit(f"fab {' '.join(args)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return result.stdout


def run_all(args) -> tuple[dict, str]:
    """Up, data, one run per node count at the same global batch, `fab plan` from the 1-node run, down."""
    summaries = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, GPU_CLUSTER_INVENTORY=f"{tmp}/inv.json")
        env["PATH"] = f"{REPO / '.venv' / 'bin'}:{env.get('PATH', '')}"
        shared = localcluster.STATE_ROOT / args.name / "shared"
        up = ("local.up", "--nodes", "3", "--link", args.link, "--name", args.name, "--subnet", args.subnet)
        fab(env, *up, "--replace")
        try:
            fab(env, "data", "--extra", "--train 20000 --valid 100 --test 50")
            for nodes in (1, 2, 3):
                run = f"plan-n{nodes}"
                fab(
                    env,
                    *(
                        "train",
                        "--run",
                        run,
                        "--recipe",
                        args.recipe,
                        "--nodes",
                        str(nodes),
                        "--steps",
                        str(args.steps),
                    ),
                    *("--batch-per-gpu", str(args.batch // nodes), "--follow", "--extra", QUIET),
                )
                summaries[nodes] = json.loads((rundir.run_dir(shared, run) / rundir.SUMMARY).read_text())
            shown = fab(env, "plan", "--run", "plan-n1", "--steps", "1000", "--max-nodes", "3", check=False)
        finally:
            fab(env, "local.down", "--name", args.name, "--yes")  # a benchmark keeps no run
    return summaries, shown


def errors(summaries: dict, link: str) -> list[str]:
    cpus = len(os.sched_getaffinity(0))
    rate = analysis.tc_rate_gbit(link)
    local = planning.Offer("local", planning.CPU, 1, None, "none", rate, link, cpus)
    lines = [f"{'from':<8} {'nodes':>5} {'predicted':>9} {'measured':>9} {'error':>7}"]
    records = {nodes: rundir.Summary.from_json(summary) for nodes, summary in summaries.items()}
    for source in (1, 2):
        base = planning.base_from_run(f"plan-n{source}", records[source], planning.CPU, 1, (rate, link))
        for nodes, summary in records.items():
            e = planning.estimate(base, local, nodes, 1, planning.Storage())
            measured = summary.avg_step_time_s or 0.0
            assert e.step_s is not None, e.refused
            error = e.step_s / measured - 1
            lines.append(f"{source} node  {nodes:>5} {e.step_s * 1e3:>9.0f} {measured * 1e3:>9.0f} {error:>+7.0%}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="transformer-tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=12, help="the global batch (divisible by 1, 2 and 3)")
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--name", default="planb")
    parser.add_argument("--subnet", default="10.213.61.0/24")
    parser.add_argument("--save", help="write the runs' summaries into this JSON file")
    parser.add_argument("--wait-lock", action="store_true", help="wait for another emulated cluster run to end")
    args = parser.parse_args()
    try:
        with onecluster.held(wait=args.wait_lock):
            summaries, shown = run_all(args)
    except onecluster.ClusterBusy as busy:
        raise SystemExit(str(busy)) from None
    if args.save:
        Path(args.save).write_text(json.dumps({str(k): v for k, v in summaries.items()}, indent=2))
    print(shown)
    print(f"{args.recipe}, global batch {args.batch}, {args.steps} steps, link {args.link}")
    print("\n".join(errors(summaries, args.link)))


if __name__ == "__main__":
    main()
