"""The runs on /data for the laptop, one round trip each, JSON on stdout:
python -m cluster_node.programs.runs overview --data /data   the active (else latest) run and its state files
python -m cluster_node.programs.runs list --data /data       every run's progress, summary, config, run_status"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from cluster_node.protocol import phases, rundir


def alive(run: Path) -> bool:
    """The run's launcher runs (on this node: launcher.pid is a head-node pid)."""
    try:
        os.kill(int((run / rundir.LAUNCHER_PID).read_text().strip()), 0)
        return True
    except (OSError, ValueError):
        return False


def current(data: Path) -> Optional[Path]:
    """The active run while its launcher lives, else the newest run directory."""
    try:
        active = rundir.active_file(data).read_text().strip()
    except OSError:
        active = ""
    if active and alive(Path(active)):
        return Path(active)
    runs = [p for p in (data / rundir.RUNS).glob("*") if p.is_dir() and not p.name.startswith(".")]
    return max(runs, key=lambda p: p.stat().st_mtime, default=None)


def overview(data: Path) -> dict:
    """{"run": path or null, "status", "progress", "summary": dicts, "restarts": list}; a missing or
    unreadable file is empty."""
    run = current(data)
    if run is None:
        return {"run": None}
    files = {"status": rundir.RUN_STATUS, "progress": rundir.PROGRESS, "summary": rundir.SUMMARY}
    found = {key: rundir.read_json(run / name, {}) for key, name in files.items()}
    return {"run": str(run), **found, "restarts": rundir.read_json(run / rundir.RESTARTS, []) or []}


def listing(data: Path) -> list[dict]:
    """One row per run directory (one with a spec.json or a summary.json; scale series are not runs)."""
    names = {"progress": rundir.PROGRESS, "summary": rundir.SUMMARY, "config": rundir.CONFIG}
    rows = []
    for run in sorted((data / rundir.RUNS).glob("*/")):
        if (run / rundir.SPEC).exists() or (run / rundir.SUMMARY).exists():
            row = {key: rundir.read_json(run / name, {}) for key, name in names.items()}
            row |= {"segments": rundir.read_json(run / rundir.SEGMENTS, []) or []}
            row["phases"] = [mark.to_json() for mark in phases.read(run)]  # for fab runs' goodput column
            rows.append({"run": run.name, **row, "run_status": rundir.read_json(run / rundir.RUN_STATUS, {})})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster_node.programs.runs", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("overview", "list"))
    parser.add_argument("--data", default="/data")
    args = parser.parse_args(argv)
    data = Path(args.data)
    print(json.dumps(overview(data) if args.what == "overview" else listing(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
