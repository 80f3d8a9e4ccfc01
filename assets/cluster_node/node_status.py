"""One node's row of `fab status` as JSON: python -m cluster_node.node_status --data /data --name node0
{"ready": bootstrap finished, "mounted": /data is a mount, "gpus": [[util %, MiB used, MiB total], ...]
or null without nvidia-smi, "training": training processes}."""

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


def status(data: Path, name: str) -> dict:
    return {
        "ready": (data / clusterdir.CLUSTER / clusterdir.READY_DIR / name).is_file(),
        "mounted": is_mountpoint(data),
        "gpus": gpu_rows(),
        "training": training_processes(),
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
