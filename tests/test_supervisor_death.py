"""A supervisor killed outright (SIGKILL: the OOM killer, `kill -9`, a crash of the interpreter) takes its
mpirun with it (issue 28 §6): a run nobody watches would train on with no budget meter, no restart and no
then-stop. Real processes: the supervisor as `fab train` starts it, the stand-in mpirun running a program
that sleeps."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from supervisor_fixture import supervisor_process, write_spec

from cluster_node.protocol import rundir


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that is gone (init reaps those)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_sigkilled_supervisor_takes_its_mpirun_with_it(tmp_path):
    """Before: mpirun (here the program it became) went on sleeping, reparented to init."""
    run = tmp_path / "r1"
    run.mkdir()
    write_spec(run, ["sleep", "300"], ["127.0.0.1"], poll=0.2)
    supervisor = supervisor_process(run)
    pid_file = run / rundir.MPIRUN_PID
    mpirun = 0
    try:
        assert _wait(pid_file.exists, 30), "the supervisor never started mpirun"
        mpirun = int(pid_file.read_text())
        assert _wait(lambda: _alive(mpirun), 5)
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(timeout=10)
        started = time.monotonic()
        assert _wait(lambda: not _alive(mpirun), 5), "mpirun outlived its SIGKILLed supervisor"
        print(f"mpirun gone {time.monotonic() - started:.2f} s after its supervisor's SIGKILL")
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
        if mpirun and _alive(mpirun):
            os.kill(mpirun, signal.SIGKILL)
