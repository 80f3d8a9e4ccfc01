"""One emulated cluster at a time on a machine: the benchmarks take this lock themselves (flock on a
file under /tmp, or GPU_CLUSTER_LOCK), and refuse in one line when another run holds it."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

LOCK_PATH = Path(os.environ.get("GPU_CLUSTER_LOCK", "/tmp/emulated-cluster.lock"))


class ClusterBusy(RuntimeError):
    """Another emulated cluster run holds the machine's lock."""


@contextlib.contextmanager
def held(path: Path = LOCK_PATH, wait: bool = False) -> Iterator[Path]:
    """Hold the machine's emulated-cluster lock for the block (flock(2): released when the process
    exits, however it exits). Without `wait`, ClusterBusy at once when it is held."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise ClusterBusy(
                f"error: another emulated cluster run holds {path} (one at a time per machine): "
                "try again when it ends, or pass --wait-lock"
            ) from None
        yield path
