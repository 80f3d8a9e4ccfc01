"""Fan-out benchmark: how `fab status` scales with the node count (issue 12 §6: 8 nodes <= 1.5x and
32 nodes <= 2x the time of 1 node).

One emulated cluster of the largest size is brought up once; each size N gets an inventory restricted
to its first N nodes (same machine, same sshd's: only the fan-out differs). Each size runs the real
`fab status` as a subprocess `--repeat` times; the median is reported with its ratio to the smallest.
Needs root. It holds the machine's one-cluster lock while its cluster is up (clusterops/local/lock.py:
/tmp/emulated-cluster.lock or GPU_CLUSTER_LOCK) and refuses in one line when another run holds it
(--wait-lock waits):

    .venv/bin/python scripts/bench_fanout.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from clusterops.inventory import Inventory
from clusterops.local import lock as onecluster

REPO = Path(__file__).resolve().parent.parent


def fab(args: list[str], inventory: Path) -> float:
    """Seconds one real `fab` command takes, start to exit (it must succeed)."""
    env = dict(os.environ, GPU_CLUSTER_INVENTORY=str(inventory))
    env["PATH"] = f"{REPO / '.venv' / 'bin'}:{env.get('PATH', '')}"
    started = time.perf_counter()
    result = subprocess.run(["fab", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"error: fab {' '.join(args)} failed: {(result.stderr or result.stdout).strip()[-400:]}")
    return seconds


def restricted(full: Inventory, count: int, workdir: Path) -> Path:
    path = workdir / f"inventory-{count}.json"
    replace(full, nodes=full.nodes[:count]).save(path)
    return path


def measure(full_path: Path, sizes: list[int], repeat: int, task: list[str], workdir: Path) -> dict[int, float]:
    full = Inventory.load(full_path)
    medians = {}
    for count in sizes:
        inventory = restricted(full, count, workdir)
        fab(task, inventory)  # warm the page cache and the nodes' sshd's
        times = [fab(task, inventory) for _ in range(repeat)]
        medians[count] = statistics.median(times)
        rounded = [round(t, 2) for t in times]
        print(f"{count:>3} node(s): fab {' '.join(task)} median {medians[count]:.2f} s of {rounded}")
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,8,32", help="node counts, comma-separated (default 1,8,32)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; the median counts (default 3)")
    parser.add_argument("--name", default="hfan", help="cluster name (default hfan)")
    parser.add_argument("--subnet", default="10.213.232.0/24")
    parser.add_argument("--wait-lock", action="store_true", help="wait for another emulated cluster run to end")
    args = parser.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    try:
        with onecluster.held(wait=args.wait_lock):
            medians = run_all(args, sizes)
    except onecluster.ClusterBusy as busy:
        print(busy, file=sys.stderr)
        return 1
    first = sizes[0]
    for count in sizes[1:]:
        print(f"{count} nodes / {first} node(s): {medians[count] / medians[first]:.2f}x")
    return 0


def run_all(args, sizes: list[int]) -> dict[int, float]:
    """Up at the largest size, `fab status` at each, down."""
    with tempfile.TemporaryDirectory(prefix="bench-fanout-") as tmp:
        workdir = Path(tmp)
        full = workdir / "inventory.json"
        up = ["local.up", "--nodes", str(sizes[-1]), "--name", args.name, "--subnet", args.subnet, "--replace"]
        fab(up, full)
        try:
            baseline = fab(["--list"], full)
            print(f"fab --list (process start-up, no SSH): {baseline:.2f} s")
            medians = measure(full, sizes, args.repeat, ["status"], workdir)
        finally:
            fab(["local.down", "--name", args.name, "--yes"], full)  # a benchmark keeps no run
    return medians


if __name__ == "__main__":
    sys.exit(main())
