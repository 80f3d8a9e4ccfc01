"""The runs on /data for the laptop, one round trip each, JSON on stdout:
python -m cluster_node.programs.runs overview --data /data   the active (else latest) run and its state files
python -m cluster_node.programs.runs current --data /data    the active (else latest) run's directory
python -m cluster_node.programs.runs list --data /data       every run's progress, summary, config, status, ...
python -m cluster_node.programs.runs files --run RUN NAME... RUN's run files (rundir names) as JSON: the laptop's
    clusterops.nodes.records decodes them into rundir's records (in place of `cat` over SSH)
python -m cluster_node.programs.runs at-risk --data /data    what deleting /data would lose: the active run, the runs
    never fetched or changed since (`fab destroy`, `fab local.down`)"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from cluster_node.protocol import phases, rundir

SUPERVISOR_MODULE = "cluster_node.supervisor.loop"  # in the supervisor's command line (programs.start)


def alive(run: Path) -> bool:
    """The run's launcher runs (on this node: launcher.pid is a head-node pid), as the supervisor: a container
    started again numbers its processes from 1, so the pid may now be another process's."""
    try:
        pid = int((run / rundir.LAUNCHER_PID).read_text().strip())
        os.kill(pid, 0)
        return SUPERVISOR_MODULE.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return False


def active_run(data: Path) -> Optional[Path]:
    """The run runs/.active names while its launcher lives, else None."""
    try:
        active = rundir.active_file(data).read_text().strip()
    except OSError:
        active = ""
    return Path(active) if active and alive(Path(active)) else None


def launched(run: Path) -> tuple[bool, float]:
    """When the run was last launched: its spec.json's time (every launch and attempt writes it); a folder
    without one (fab scale's results, a run of an older launcher) after every run with one, by its own time.
    Not the directory's time alone: any file made in it moves that (fab fetch's marker, fab report's files,
    a STOP), and an old run fetched would become the latest."""
    for path, launched_here in ((run / rundir.SPEC, True), (run, False)):
        try:
            return launched_here, path.stat().st_mtime
        except OSError:
            continue
    return False, 0.0


def current(data: Path) -> Optional[Path]:
    """The active run while its launcher lives, else the run launched last."""
    runs = [p for p in (data / rundir.RUNS).glob("*") if p.is_dir() and not p.name.startswith(".")]
    return active_run(data) or max(runs, key=launched, default=None)


def current_answer(data: Path) -> dict:
    """{"run": current's directory, or null}."""
    run = current(data)
    return {"run": str(run) if run else None}


def overview(data: Path) -> dict:
    """The active (else latest) run's state files, as `files` gives them; {"run": null} without a run."""
    run = current(data)
    return {"run": None} if run is None else files(run, OVERVIEW)


def listing(data: Path) -> list[dict]:
    """One `files` answer per run directory (one with a spec.json or a summary.json; scale series are
    not runs), "run" its name."""
    rows = []
    for run in sorted((data / rundir.RUNS).glob("*/")):
        if (run / rundir.SPEC).exists() or (run / rundir.SUMMARY).exists():
            rows.append({**files(run, LISTED), "run": run.name})  # phases: fab runs' goodput column
    return rows


# The run files `files` reads: rundir's JSON files, and phases.jsonl as the list of its lines.
FILES: tuple[str, ...] = (
    rundir.RUN_STATUS,
    rundir.PROGRESS,
    rundir.SUMMARY,
    rundir.CONFIG,
    rundir.RESTARTS,
    rundir.HANGS,
)
FILES += (rundir.SEGMENTS, rundir.BUDGET, rundir.SPEC, rundir.INTERRUPTIONS, rundir.PHASES)
OVERVIEW = (rundir.RUN_STATUS, rundir.PROGRESS, rundir.SUMMARY, rundir.RESTARTS)
LISTED = (rundir.RUN_STATUS, rundir.PROGRESS, rundir.SUMMARY, rundir.CONFIG, rundir.SEGMENTS, rundir.PHASES)


def files(run: Path, names: Sequence[str]) -> dict:
    """{"run": RUN, "files": {NAME: its JSON, null when missing or empty}, "torn": {NAME: why, for a file
    that is not JSON (read as missing, as rundir.read_json reads it)}}. phases.jsonl: its lines' records."""
    found: dict = {}
    torn: dict = {}
    for name in names:
        if name == rundir.PHASES:
            found[name] = [mark.to_json() for mark in phases.read(run)]
            continue
        try:
            text = (run / name).read_text()
        except OSError:
            text = ""
        try:
            found[name] = json.loads(text) if text.strip() else None
        except ValueError as error:
            found[name], torn[name] = None, f"{error}: {text.strip()[:200]!r}"
    return {"run": str(run), "files": found, "torn": torn}


def fetched_files(run: Path) -> list[Path]:
    """The files of `run` that `fab fetch` would bring home now."""
    found = [run / name for name in rundir.FETCHED_FILES if (run / name).is_file()]
    best = run / rundir.CHECKPOINTS / rundir.BEST_CHECKPOINT
    steps = sorted((run / rundir.CHECKPOINTS).glob(rundir.CHECKPOINT_GLOB))
    found += [best] if best.is_file() else steps[-1:]
    found += sorted(p for p in (run / rundir.EVAL).glob("*") if p.is_file())[-3:]
    return found


def unfetched_runs(data: Path) -> list[str]:
    """Runs never fetched, or with a file fetch takes changed since the last fetch. A run counts as fetched
    when every file `fab fetch` brings home is older than the `.fetched` marker fetch leaves on the cluster
    (clusterops/nodes/remote.py); files fetch never takes (progress.json, rank logs, older checkpoints) leave
    a fetched run fetched (issue 23 §4)."""
    found = []
    for run in sorted(p for p in (data / rundir.RUNS).glob("*") if p.is_dir() and not p.name.startswith(".")):
        marker = run / rundir.FETCHED
        fetched_at = marker.stat().st_mtime if marker.exists() else None
        if fetched_at is None or any(f.stat().st_mtime > fetched_at for f in fetched_files(run)):
            found.append(run.name)
    return found


def at_risk(data: Path) -> dict:
    """What deleting /data would lose: {"active": the run whose launcher lives, or null; "unfetched": names}."""
    active = active_run(data)
    return {"active": active.name if active else None, "unfetched": unfetched_runs(data)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster_node.programs.runs", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("overview", "current", "list", "files", "at-risk"))
    parser.add_argument("--data", default="/data")
    parser.add_argument("--run", help="files: the run directory")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"files: of {', '.join(FILES)}")
    args = parser.parse_intermixed_args(argv)  # the NAMEs after --run RUN
    unknown = [name for name in args.names if name not in FILES]
    if args.what == "files" and (not args.run or not args.names or unknown):
        parser.error(
            f"files needs --run RUN and NAMEs of {', '.join(FILES)}" + f" (not {', '.join(unknown)})" * bool(unknown)
        )
    if args.what == "files":
        print(json.dumps(files(Path(args.run), args.names)))
    else:
        data = Path(args.data)
        answer = {"overview": overview, "current": current_answer, "list": listing, "at-risk": at_risk}[args.what]
        print(json.dumps(answer(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
