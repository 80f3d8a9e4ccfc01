"""A hung attempt: every rank's Python stack, and the rank that is behind.

On each node of the attempt the supervisor runs `python -m cluster_node.supervisor.hang dump RUN_DIR` over ssh: it
prints `PID STATE HOST` for every rank of the run (its stdout becomes stacks/states.HOST), starts py-spy where
installed and sends SIGUSR2 (the rank's faulthandler writes stacks/rankN.txt, train.py). `behind()` then
names the rank from the heartbeats, the process states and which stacks came."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

from cluster_node.protocol import rundir


def heartbeats(run: Path) -> dict[int, dict]:
    """Per rank: its last finished step, pid, host and when it wrote that."""
    out = {}
    for path in (run / rundir.RANKS).glob("rank*"):
        try:
            beat = rundir.RankBeat.from_text(path.read_text())
            when = path.stat().st_mtime
            out[int(path.name[4:])] = {"step": beat.step, "pid": beat.pid, "host": beat.host, "time": when}
        except (OSError, ValueError):
            continue
    return out


def states(run: Path) -> dict[tuple[Optional[str], int], str]:
    """(host, pid) -> process state letter, from the `PID STATE HOST` lines collected per node. Keyed by host
    too: each node's container has a PID namespace of its own (docker run without --pid), so ranks on two
    nodes can share a pid. HOST is the node's hostname, as the ranks' heartbeats carry it; None on a line
    without one (an older image's dump)."""
    out: dict[tuple[Optional[str], int], str] = {}
    for path in (run / rundir.STACKS).glob(rundir.HOST_STATES.format(host="*")):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) in (2, 3) and parts[0].isdigit():
                out[(parts[2] if len(parts) == 3 else None, int(parts[0]))] = parts[1]
    return out


def _state(procs: dict[tuple[Optional[str], int], str], beat: dict) -> Optional[str]:
    return procs.get((beat["host"], beat["pid"]), procs.get((None, beat["pid"])))


def behind(run: Path) -> tuple[Optional[int], str]:
    """The rank that is behind: a stopped process (state T) or one whose stack dump never came, else
    the lowest step, else the oldest heartbeat. Returns (rank, one line with the evidence)."""
    beats, procs = heartbeats(run), states(run)
    if not beats:
        return None, "no rank wrote a heartbeat"
    dumps = {r: run / rundir.STACKS / rundir.RANK_STACK.format(rank=r) for r in beats}
    stacks = {r for r, path in dumps.items() if path.exists() and path.stat().st_size > 0}

    def suspicion(rank: int) -> tuple:
        beat = beats[rank]
        return (_state(procs, beat) != "T", rank in stacks, beat["step"], beat["time"])

    rank = min(beats, key=suspicion)
    beat = beats[rank]
    state = _state(procs, beat) or "?"
    evidence = (
        f"rank {rank} (pid {beat['pid']} on {beat['host']}) is behind: step {beat['step']}, process state "
        f"{state}{' (stopped)' if state == 'T' else ''}, {'stack dumped' if rank in stacks else 'no stack dump'}; "
        f"steps per rank {dict(sorted((r, b['step']) for r, b in beats.items()))}"
    )
    return rank, evidence


def record(run: Path, now: float) -> str:
    """Name the rank behind, append it to hangs.json, return the evidence."""
    rank, evidence = behind(run)
    rundir.append(run / rundir.HANGS, rundir.Hang(time=now, rank=rank, evidence=evidence))
    return evidence


def _ranks(run: str) -> list[tuple[int, str]]:
    """(pid, state) of this run's ranks on this node: its processes (`--run-dir RUN` in the command), not
    mpirun, nor a rank's forked DataLoader workers: a child with its parent's very command line (a ResNet
    rank on a p4d has 22, and py-spying ~180 processes outlasts the dump's time). A parent with another
    command line that carries the rank's arguments (a wrapper, a launcher) is no fork: both stay."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
            comm = (entry / "comm").read_text().strip()
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue
        flag = [i for i, a in enumerate(args) if a == b"--run-dir" and args[i + 1 : i + 2] == [run.encode()]]
        if flag and comm != "mpirun":
            found[int(entry.name)] = (state, int(parent), args)
    forks = {pid for pid, (_, parent, args) in found.items() if parent in found and found[parent][2] == args}
    return [(pid, state) for pid, (state, _, _) in sorted(found.items()) if pid not in forks]


def dump(run: str) -> int:
    """On one node: print `PID STATE HOST` of every rank, py-spy each (where installed), SIGUSR2 each."""
    spies = []
    for pid, state in _ranks(run):
        print(pid, state, socket.gethostname(), flush=True)
        if shutil.which("py-spy"):
            out = Path(run) / rundir.STACKS / rundir.PY_SPY.format(host=socket.gethostname(), pid=pid)
            with open(out, "w") as handle:
                command = ["py-spy", "dump", "--nonblocking", "--pid", str(pid)]
                spies.append(subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT))
        try:
            os.kill(pid, signal.SIGUSR2)
        except OSError:
            pass
    for spy in spies:
        spy.wait(timeout=15)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["dump"] or len(sys.argv) != 3:
        sys.exit("usage: python -m cluster_node.supervisor.hang dump RUN_DIR")
    sys.exit(dump(sys.argv[2]))
