"""The supervisor run for real on this machine (no cluster): a run spec as `fab train` writes it, a
stand-in ssh (every node answers, or one is dead) and a stand-in mpirun (tests/supervisor_standins/mpirun:
the program once, here) on PATH, `python -m cluster_node.supervisor.loop RUN_DIR`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from conftest import REPO

from cluster_node.protocol import rundir, spec

STANDINS = REPO / "tests" / "supervisor_standins"
ANSWERING_SSH = "#!/bin/sh\nexit 0\n"


def write_spec(
    run: Path, program: Sequence[str], hosts: Sequence[str] = ("10.0.0.1",), **limits: float
) -> spec.RunSpec:
    """Attempt 1 of a run of `program` on `hosts` (one slot each); limits as in spec.Limits."""
    values = {"poll": 1.0, "cleanup": 0.0, **limits}
    run_spec = spec.RunSpec(
        run=str(run),
        attempt=1,
        supervisor_host=hosts[0],
        hosts=tuple(hosts),
        pool=tuple(hosts),
        slots=1,
        env={"MASTER_ADDR": hosts[0]},
        process_env={"HWLOC_COMPONENTS": "-gl"},
        mpirun_options=(),
        program=tuple(program),
        ssh_config="/dev/null",
        active_file=str(run / "active"),
        python=sys.executable,
        root=str(REPO / "assets"),
        resume=("fab", "train", "--run", run.name),
        limits=spec.Limits(**values),  # type: ignore[arg-type]
    )
    spec.write(run, run_spec)
    return run_spec


def _environment(run: Path, ssh: str, base: Optional[dict] = None, **more: str) -> dict:
    """PATH with the stand-in ssh (run/bin) and mpirun first; the checkout's cluster_node importable."""
    bin_dir = run / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ssh").write_text(ssh)
    (bin_dir / "ssh").chmod(0o755)
    path = f"{bin_dir}:{STANDINS}:{os.environ['PATH']}"
    pythonpath = f"{REPO / 'assets'}:{os.environ.get('PYTHONPATH', '')}"
    return dict(base or os.environ, PATH=path, PYTHONPATH=pythonpath, **more)


def supervise(run: Path, ssh: str = ANSWERING_SSH, timeout: float = 60, env: Optional[dict] = None, **more: str):
    """Run the supervisor to its end; returns the completed process (run-status.json holds the verdict)."""
    return subprocess.run(
        [sys.executable, "-m", "cluster_node.supervisor.loop", str(run)],
        timeout=timeout,
        capture_output=True,
        text=True,
        env=_environment(run, ssh, env, **more),
    )


def status(run: Path) -> dict:
    return json.loads((run / rundir.RUN_STATUS).read_text())


def supervisor_process(run: Path) -> subprocess.Popen:
    """The supervisor started as `fab train` starts it, not waited for (an answering ssh on PATH)."""
    env = _environment(run, ANSWERING_SSH)
    return subprocess.Popen([sys.executable, "-m", "cluster_node.supervisor.loop", str(run)], env=env)
