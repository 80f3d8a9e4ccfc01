"""One node's row of `fab status` as JSON: python -m cluster_node.programs.node_status --data /data --name node0
{"ready": bootstrap finished, "mounted": /data is a mount, "gpus": [[util %, MiB used, MiB total], ...]
or null without nvidia-smi, "training": training processes, "deploy": the bootstrap's timeline,
{"started": epoch s, "total_s": first start to last end, "steps": [[step, seconds, ok], ...]} or null}."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from cluster_node.protocol import clusterdir
from cluster_node.tools import have, is_mountpoint, run


def gpu_rows() -> Optional[list[list[int]]]:
    if not have("nvidia-smi"):
        return None
    _, out = run(
        ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used,memory.total", "--format=csv,noheader,nounits"]
    )
    return [[int(float(v)) for v in line.split(",")] for line in out.splitlines() if line.strip()]


def training_processes(proc: Path = Path("/proc")) -> int:
    return len(training_pids(proc))


def training_pids(proc: Path = Path("/proc")) -> set[int]:
    """The trainer's ranks on this node: python processes running `-m train.train` (not mpirun or a
    shell whose command line carries the same words), not a rank's own children (DataLoader workers
    fork with its command line) and only in this node's network namespace (the emulated cluster's nodes
    share one machine's /proc)."""
    own = _netns(proc / "self")
    parents: dict[int, int] = {}  # a rank's pid -> its parent's
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue  # the process ended while we looked
        if Path(argv[0].decode(errors="replace")).name.startswith("python") and b"train.train" in argv[1:4]:
            if own and _netns(cmdline.parent) not in (own, None):
                continue  # another node's
            parents[int(cmdline.parent.name)] = _parent(cmdline.parent)
    return {pid for pid, parent in parents.items() if parent not in parents}


def _netns(process: Path) -> Optional[str]:
    try:
        return os.readlink(process / "ns" / "net")
    except OSError:
        return None


def _parent(process: Path) -> int:
    try:  # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses
        return int((process / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def deploy_timeline(path: Path) -> Optional[dict]:
    """The node's deploy timeline (clusterdir.DEPLOY_FORMAT, node-bootstrap.sh); None when missing. A line
    that does not parse (a copy cut short) is skipped."""
    try:
        text = path.read_text()
    except OSError:
        return None
    spans = []
    for line in text.splitlines():
        parts = line.split()
        try:
            spans.append((parts[0], float(parts[1]), float(parts[2]), parts[3:] != ["failed"]))
        except (IndexError, ValueError):
            continue
    if not spans:
        return None
    steps = [[step, round(end - start, 3), ok] for step, start, end, ok in spans]
    started = spans[0][1]
    return {"started": started, "total_s": round(spans[-1][2] - started, 3), "steps": steps}


def status(data: Path, name: str) -> dict:
    return {
        "ready": clusterdir.node_file(data, clusterdir.READY_DIR, name).is_file(),
        "mounted": is_mountpoint(data),
        "gpus": gpu_rows(),
        "training": training_processes(),
        "deploy": deploy_timeline(clusterdir.node_file(data, clusterdir.DEPLOY_DIR, name)),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster_node.programs.node_status", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--data", default="/data")
    parser.add_argument("--name", required=True, help="this node's name (nodeN): its bootstrap's ready mark")
    args = parser.parse_args(argv)
    print(json.dumps(status(Path(args.data), args.name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
