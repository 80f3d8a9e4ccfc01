"""What the emulated cluster's shared /data holds, and which runs `fab local.down` would lose (the node
program's rule, cluster_node.programs.runs.unfetched_runs: the same as `fab destroy`'s on AWS)."""

from __future__ import annotations

from pathlib import Path

from cluster_node.programs.runs import unfetched_runs
from cluster_node.protocol import rundir

__all__ = ["describe_data", "unfetched_runs"]


def describe_data(shared: Path) -> str:
    """What the shared /data holds, in a few words: data sets and runs (unfetched ones marked)."""
    datasets = sorted(p.name for p in (shared / "datasets").glob("*") if p.is_dir())
    runs = sorted(p.name for p in (shared / rundir.RUNS).glob("*") if p.is_dir())
    unfetched = set(unfetched_runs(shared))
    parts = []
    if datasets:
        parts.append(f"data sets {', '.join(datasets)}")
    if runs:
        parts.append("runs " + ", ".join(r + (" (not fetched)" if r in unfetched else "") for r in runs))
    return "; ".join(parts) or "no data sets or runs"
