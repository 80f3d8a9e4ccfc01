"""Claim the head node for one run and start its supervisor: `python -m cluster_node.programs.start PAYLOAD`, sent by
`fab train` over SSH. PAYLOAD is a JSON file fab uploaded to the head node ({"spec": RunSpec JSON, "probe":
the probe line}); it is removed here. Prints one JSON line: {"run", "log_offset"} once the supervisor wrote
its status, or {"refused": WHY} when a run is going, having changed nothing.

The check "is a run going" (runs/.active naming a run whose launcher.pid lives) and the launch are one step
under an exclusive flock(2) on LAUNCH_LOCK, held until the new supervisor's status exists; a rival launch
waits for it and then finds the run going. Where the lock lives, and why:
- on the head node's own disk (/run): every launch goes through the head node's sshd, so a node-local lock
  holds across every `fab train`; the kernel drops it when its holder dies however it dies, so a launch
  killed half-way leaves no claim behind (man 2 flock: the lock belongs to the open file description).
- not a flock on /data: on NFS (EFS) Linux emulates flock(2) with a whole-file byte-range lock (man 2 flock,
  "NFS details"), a lease the server keeps for a client that went quiet; it holds across nodes, which a
  claim on the head does not need.
- not a mkdir on /data: atomic on NFS, but it outlives a launch that died, so it would need a timeout."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Optional

from cluster_node.programs.runs import alive
from cluster_node.protocol import rundir
from cluster_node.protocol import spec as specs

LOCK_WAIT = 30.0  # a rival launch holds the claim for a few seconds (the supervisor's start)
START_WAIT = 10.0  # the supervisor writes its status within this
# What a new launch removes: the files of the run's last segment that would mislead the new one.
STALE = (rundir.STOP, rundir.STOP_TAKEN, rundir.FORCED, rundir.RUN_STATUS, rundir.RESTARTS, rundir.HANGS, rundir.SPEC)


def going(active_file: Path) -> Optional[str]:
    """The run runs/.active names while its supervisor lives (on this node), else None."""
    try:
        named = active_file.read_text().strip()
    except OSError:
        return None
    return named if named and alive(Path(named)) else None


def refusal(run: str) -> str:
    return f"a run is already going in {run}: `fab logs --follow` to watch it, `fab stop` to end it"


def claim(handle: IO, wait: float = LOCK_WAIT) -> bool:
    """The exclusive flock on `handle`, waiting up to `wait` s for a rival launch to finish starting."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


def prepare(run: Path, spec: specs.RunSpec, probe: str) -> int:
    """The run directory ready for attempt 1; returns train.log's size (where this launch's output starts)."""
    (run / rundir.SPECS).mkdir(parents=True, exist_ok=True)
    for name in STALE:
        (run / name).unlink(missing_ok=True)
    for old in (run / rundir.SPECS).iterdir():
        old.unlink()
    specs.write(run, spec)
    (run / rundir.PROBE_SH).write_text(probe + "\n")
    rundir.write_bytes(Path(spec.active_file), f"{run}\n".encode())
    try:
        return (run / rundir.TRAIN_LOG).stat().st_size
    except OSError:
        return 0


def supervise(run: Path, spec: specs.RunSpec) -> subprocess.Popen:
    """The supervisor, detached: its own session (it outlives the SSH session), output in launcher.log, and
    cluster_node found through PYTHONPATH (spec.root: the image's, fab sync's, or the checkout's)."""
    env = {**os.environ, **({"PYTHONPATH": spec.root} if spec.root else {})}
    with open(run / rundir.LAUNCHER_LOG, "wb") as log:
        argv = [spec.python, "-m", "cluster_node.supervisor.loop", str(run)]
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )


def started(run: Path, child: subprocess.Popen, wait: float = START_WAIT) -> bool:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and child.poll() is None:
        if rundir.read_json(run / rundir.RUN_STATUS):
            return True
        time.sleep(0.1)
    return bool(rundir.read_json(run / rundir.RUN_STATUS))


def start(payload: dict, lock: Path) -> dict:
    spec = specs.RunSpec.from_json(payload["spec"])
    run = Path(spec.run)
    with open(lock, "a") as handle:
        if not claim(handle):
            return {"refused": f"another launch has held {lock} for {LOCK_WAIT:.0f} s: try again"}
        running = going(Path(spec.active_file))
        if running:
            return {"refused": refusal(running)}
        offset = prepare(run, spec, payload["probe"])
        if not started(run, supervise(run, spec)):
            return {"error": f"the launcher did not start; see {run / rundir.LAUNCHER_LOG}"}
    return {"run": str(run), "log_offset": offset}


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 3) or (len(argv) == 3 and argv[1] != "--lock"):
        print("usage: python -m cluster_node.programs.start PAYLOAD [--lock PATH]", file=sys.stderr)
        return 2
    path = Path(argv[0])
    payload = rundir.read_json(path)
    path.unlink(missing_ok=True)
    if not isinstance(payload, dict):
        print(json.dumps({"error": f"{path}: no launch payload"}))
        return 1
    result = start(payload, Path(argv[2]) if len(argv) == 3 else Path(rundir.LAUNCH_LOCK))
    print(json.dumps(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
