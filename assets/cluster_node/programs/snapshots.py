"""The in-memory snapshots this node holds (train.snapshot writes them; issue 30), for the supervisor's
restart: `held` prints {run name: {"step", "bytes"}} (the probe reports it too), `persist RUN_DIR STEP`
copies this node's snapshot of the run at STEP into RUN_DIR/checkpoints as a step checkpoint, so that a
restart whose nodes do not all hold it (a replaced node, a survivor whose last write was cut short) resumes
from it, from /data; `drop RUN_DIR` frees this node's memory of a run that ended at a checkpoint.
python -m cluster_node.programs.snapshots held|persist|drop ..."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

from cluster_node.protocol import rundir


def held(root: Path) -> dict[str, dict]:
    """Run name -> its newest complete snapshot here (a writer's temp file is not one: it has no step name)."""
    out = {}
    for run in sorted(root.glob("*")) if root.is_dir() else []:
        files = [(rundir.snapshot_step(p), p) for p in run.glob(rundir.SNAPSHOT_GLOB)]
        steps = [(step, p) for step, p in files if step is not None]
        if steps:
            step, path = max(steps)
            out[run.name] = {"step": step, "bytes": _size(path)}
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class PersistError(Exception):
    pass


def persist(run: Path, step: int, env: Optional[Mapping[str, str]] = None) -> dict:
    """Copy this node's snapshot of `run` at `step` to RUN/checkpoints/step_STEP.pt: a temp file beside it
    (the trainer's next save clears one a killed copy left), fsync, rename. An existing checkpoint of that
    step is kept: it is the same state, written by the trainer."""
    source = rundir.snapshot_root(env) / run.resolve().name / rundir.SNAPSHOT.format(step=step)
    target = rundir.checkpoint(run, step)
    if target.exists():
        return {"path": str(target), "bytes": _size(target), "seconds": 0.0, "copied": False}
    if not source.exists():
        raise PersistError(f"no snapshot of {run.name} at step {step} on this node ({source})")
    began, caller = time.monotonic(), os.getppid()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
    try:
        with open(source, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
            dst.flush()
            os.fsync(dst.fileno())
        if os.getppid() != caller:  # the supervisor's ssh is gone: it has planned without this copy
            raise PersistError(f"the copy's caller went away; {target.name} not written")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"path": str(target), "bytes": _size(target), "seconds": round(time.monotonic() - began, 3), "copied": True}


def drop(run: Path, env: Optional[Mapping[str, str]] = None) -> int:
    """Remove this node's snapshots of `run` (and a dead writer's temp files); how many files went."""
    held = rundir.snapshot_root(env) / run.resolve().name
    files = [p for p in held.glob("*") if p.is_file()] if held.is_dir() else []
    for path in files:
        path.unlink(missing_ok=True)
    if held.is_dir():
        try:
            held.rmdir()
        except OSError:  # a writer that started meanwhile
            pass
    return len(files)


def main(argv: Optional[Sequence[str]] = None) -> int:
    prog, about = "python -m cluster_node.programs.snapshots", __doc__.splitlines()[0]
    parser = argparse.ArgumentParser(prog=prog, description=about)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("held", help="the snapshots this node holds, by run name")
    copy = commands.add_parser("persist", help="copy this node's snapshot of a run into its checkpoints")
    copy.add_argument("run_dir", type=Path)
    copy.add_argument("step", type=int)
    commands.add_parser("drop", help="remove this node's snapshots of a run").add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "held":
        print(json.dumps(held(rundir.snapshot_root())))
        return 0
    if args.command == "drop":
        print(json.dumps({"dropped": drop(args.run_dir)}))
        return 0
    try:
        print(json.dumps(persist(args.run_dir, args.step)))
    except (PersistError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
