"""One node's row of `fab status` as JSON: python -m cluster_node.node_status --data /data --name node0
{"ready": bootstrap finished, "mounted": /data is a mount, "gpus": [[util %, MiB used, MiB total], ...]
or null without nvidia-smi, "training": training processes, "deploy": the bootstrap's timeline,
{"started": epoch s, "total_s": first start to last end, "steps": [[step, seconds, ok], ...]} or null}."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from . import clusterdir
from .tools import have, is_mountpoint, run


def gpu_rows() -> Optional[list[list[int]]]:
    if not have("nvidia-smi"):
        return None
    _, out = run(
        ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used,memory.total", "--format=csv,noheader,nounits"]
    )
    return [[int(float(v)) for v in line.split(",")] for line in out.splitlines() if line.strip()]


def training_processes() -> int:
    """The trainer's ranks on this node: python processes running `-m train.train` (not mpirun or a
    shell whose command line carries the same words)."""
    count = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue  # the process ended while we looked
        if Path(argv[0].decode(errors="replace")).name.startswith("python") and b"train.train" in argv[1:4]:
            count += 1
    return count


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
    parser = argparse.ArgumentParser(prog="python -m cluster_node.node_status", description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="/data")
    parser.add_argument("--name", required=True, help="this node's name (nodeN): its bootstrap's ready mark")
    args = parser.parse_args(argv)
    print(json.dumps(status(Path(args.data), args.name)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
