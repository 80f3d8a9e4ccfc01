#!/usr/bin/env python3
"""Every `fab drill` once on the emulated cluster, each into its own running job: the timeline and the
goodput lost each prints (issue 22 §4: the figures docs/operations.md's drill table quotes).

    .venv/bin/python scripts/bench_drills.py [--kinds kill-node,stop-rank] [--link 1gbit]

Needs root. Brings up its own 3-node cluster (--name, default drillb) and takes it down at the end,
holding the machine's one-cluster lock meanwhile (clusterops/local/lock.py; --wait-lock waits).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path

from bench_plan import REPO, fab  # scripts/ is on the path of a script run from it

from cluster_node.protocol import rundir
from clusterops.local import cluster as localcluster
from clusterops.local import lock as onecluster
from clusterops.run import drill

# As the drill test's job: a restart on a lost or hung node within seconds, checkpoints every 10 steps.
JOB = ("--steps", "100000", "--batch-per-gpu", "8", "--max-restarts", "1", "--hang-seconds", "5")
TINY = "--eval-every 100000 --eval-samples 16 --checkpoint-every 10 --log-every 10 --dist-timeout-s 30"
SHOWN = re.compile(r"^(drill |outcome |timeline|  \+|goodput lost|incident )")


def wait_until(done, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} within {timeout:.0f} s: no")
        time.sleep(0.5)


def rehearse(env: dict, shared: Path, name: str, kind: str) -> list[str]:
    """One job, one drill into it, the job stopped; the drill's own lines."""
    run = f"drill-{kind}"
    files = rundir.run_dir(shared, run)
    fab(env, "train", "--run", run, *JOB, "--extra", TINY)
    wait_until(lambda: (rundir.read_json(files / rundir.PROGRESS, {}) or {}).get("step", 0) >= 15, f"{run} at step 15")
    out = fab(env, "drill", kind, "--wait", "120", check=False)
    fab(env, "stop", "--run", run, "--force", check=False)
    ended = lambda: (rundir.read_json(files / rundir.RUN_STATUS, {}) or {}).get("state") not in (None, "running")  # noqa: E731
    wait_until(ended, f"{run} ended")
    if kind == "kill-node":
        fab(env, "local.up", "--repair", "--name", name)
    return [line for line in out.splitlines() if SHOWN.match(line)] or out.splitlines()[-5:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(drill.KINDS))
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--name", default="drillb")
    parser.add_argument("--subnet", default="10.213.62.0/24")
    parser.add_argument("--save", help="write every drill's lines into this JSON file")
    parser.add_argument("--wait-lock", action="store_true", help="wait for another emulated cluster run to end")
    args = parser.parse_args()
    results = {}
    try:
        with onecluster.held(wait=args.wait_lock), tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, GPU_CLUSTER_INVENTORY=f"{tmp}/inv.json")
            env["PATH"] = f"{REPO / '.venv' / 'bin'}:{env.get('PATH', '')}"
            shared = localcluster.STATE_ROOT / args.name / "shared"
            fab(
                env,
                "local.up",
                "--nodes",
                "3",
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
                for kind in args.kinds.split(","):
                    results[kind] = rehearse(env, shared, args.name, kind)
                    print("\n".join(results[kind]) + "\n", flush=True)
            finally:
                fab(env, "local.down", "--name", args.name, "--yes")  # a benchmark keeps no run
    except onecluster.ClusterBusy as busy:
        raise SystemExit(str(busy)) from None
    if args.save:
        Path(args.save).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
