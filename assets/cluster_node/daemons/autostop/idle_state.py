"""The watchdog's idle clock, kept on disk so that a restarted watchdog (the entrypoint restarts it when
it dies; Docker restarts the container, `--restart unless-stopped`) resumes it instead of starting
over and reporting busy. It lives on /data (EFS, mounted from the host), one file per node:
/data/.cluster/autostop/nodeN.json, written atomically (a temporary file, fsync, rename; a rename is
atomic on NFS too). A new boot of the instance (a stop and start, a Spot restart, a reboot) starts a
new clock: the kernel's boot_id changes at every boot (random(4)), the container sees the host's.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from cluster_node.protocol import clusterdir

MAX_GAP_S = 10 * 60  # a longer silence within one boot: nobody watched, the clock starts again
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id(path: Path = BOOT_ID) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def state_path(data_dir: Path, rank: str) -> Path:
    return clusterdir.node_json(data_dir, clusterdir.AUTOSTOP_DIR, rank)


@dataclass
class IdleState:
    """Since when this node has watched without a break, and when the cluster was last busy."""

    boot: str
    since: float  # first observation of this unbroken watch
    last: float  # the latest observation
    busy_at: Optional[float] = None  # the latest observation with a reason to stay up
    busy: list[str] = field(default_factory=list)  # its reasons
    step: Optional[int] = None  # the latest step seen (a step that moved is a reason)
    stop_failures: int = 0  # failed stop calls since the cluster was last busy
    retry_at: float = 0.0  # no stop call before this
    memory: dict = field(default_factory=dict)  # per-signal memory (SSH byte counters, GPU processes)
    interactive_since: Optional[float] = None  # since when terminals and connections alone were the use

    def record(self, now: float, reasons: list[str], step: Optional[int]) -> None:
        if now - self.last > MAX_GAP_S:
            self.since, self.busy_at, self.busy = now, None, []
        self.last, self.step = now, step
        if reasons:
            self.busy_at, self.busy = now, list(reasons)
            self.stop_failures, self.retry_at = 0, 0.0

    def idle_for(self, now: float) -> float:
        """Seconds since the cluster was last busy, or since the watch began."""
        return now - (self.busy_at if self.busy_at is not None else self.since)


def load(path: Path, boot: str) -> Optional[IdleState]:
    """The clock a watchdog of this boot left, None when there is none (or another boot's)."""
    try:
        values = json.loads(path.read_text())
        state = IdleState(**values)
    except (OSError, ValueError, TypeError):
        return None
    return state if state.boot == boot and boot else None


def save(path: Path, state: IdleState) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as handle:
        json.dump(asdict(state), handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
