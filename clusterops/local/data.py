"""What the emulated cluster's shared /data holds, and which runs `fab local.down` would lose.

A run counts as fetched when every file `fab fetch` brings home is older than the `.fetched` marker
that fetch leaves on the cluster (clusterops/nodes/remote.py `fetch_run`, `_download_run`). Files fetch
never takes (progress.json, rank logs, older checkpoints) leave a fetched run fetched: counting them
named runs already fetched (issue 23 §4).
"""

from __future__ import annotations

from pathlib import Path

from cluster_node.protocol import rundir


def fetched_files(run: Path) -> list[Path]:
    """The files of `run` that `fab fetch` would bring home now."""
    files = [run / name for name in rundir.FETCHED_FILES if (run / name).is_file()]
    best = run / rundir.CHECKPOINTS / rundir.BEST_CHECKPOINT
    steps = sorted((run / rundir.CHECKPOINTS).glob(rundir.CHECKPOINT_GLOB))
    files += [best] if best.is_file() else steps[-1:]
    files += sorted(p for p in (run / rundir.EVAL).glob("*") if p.is_file())[-3:]
    return files


def unfetched_runs(shared: Path) -> list[str]:
    """Runs never fetched, or with a file fetch takes changed since the last fetch."""
    found = []
    for run in sorted(p for p in (shared / rundir.RUNS).glob("*") if p.is_dir()):
        marker = run / rundir.FETCHED
        fetched_at = marker.stat().st_mtime if marker.exists() else None
        if fetched_at is None or any(f.stat().st_mtime > fetched_at for f in fetched_files(run)):
            found.append(run.name)
    return found


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
