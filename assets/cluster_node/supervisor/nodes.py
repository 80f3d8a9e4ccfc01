"""What the supervisor does on the attempt's nodes, over the cluster's ssh (the run's ssh config): check
that a node answers, end a run's leftovers, collect stacks, run the health probe, and mpirun itself."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Callable, Iterable, Optional

from cluster_node.protocol import rundir
from cluster_node.protocol.spec import RunSpec


class Nodes:
    def __init__(self, run: Path, spec: RunSpec):
        self.run, self.spec = run, spec

    def _ssh(self, host: str, *command: str) -> list[str]:
        return ["ssh", "-F", self.spec.ssh_config, "-o", "ConnectTimeout=5", host, *command]

    def _call(self, argv: list[str], timeout: float, stdin: Optional[IO] = None, stdout: Optional[IO] = None) -> bool:
        try:
            out, into = stdout or subprocess.DEVNULL, stdin or subprocess.DEVNULL
            done = subprocess.run(argv, stdin=into, stdout=out, stderr=subprocess.DEVNULL, timeout=timeout)
            return done.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def ssh_ok(self, host: str) -> bool:
        return self._call(self._ssh(host, "true"), 15)

    def cleanup(self, host: str) -> bool:
        """This run's ranks and the MPI daemons on `host` (one run at a time per cluster)."""
        # [-]: the pattern must not match the remote shell that runs pkill
        kill = f"pkill -KILL -f -- '[-]-run-dir {self.run}'; pkill -KILL -x orted; pkill -KILL -x prted; true"
        return self._call(self._ssh(host, kill), 15)

    def _each(self, hosts: Iterable[str], one: Callable[[str], object]) -> None:
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(one, hosts))

    def collect_stacks(self, hosts: Iterable[str]) -> None:
        """Every rank's Python stack (cluster_node.supervisor.hang dump on each node of the attempt)."""
        env = f"PYTHONPATH={self.spec.root}" if self.spec.root else "PYTHONPATH=."

        def one(host: str) -> None:
            with open(self.run / rundir.STACKS / rundir.HOST_STATES.format(host=host), "w") as out:
                dump = self._ssh(
                    host, "env", env, self.spec.python, "-m", "cluster_node.supervisor.hang", "dump", str(self.run)
                )
                self._call(dump, 15, stdout=out)

        self._each(hosts, one)
        time.sleep(2)  # faulthandler writes from a signal handler: give the ranks a moment

    def _snapshots(self, host: str, limit: float, *args: str) -> subprocess.CompletedProcess:
        """`cluster_node.programs.snapshots ARGS` on `host`, ended there too after `limit` s (`timeout`: a copy
        left running would rename its file into the run under the next attempt); ServerAlive: a holder that
        dies mid-copy is noticed in 30 s, not TCP's minutes."""
        env = f"PYTHONPATH={self.spec.root}" if self.spec.root else "PYTHONPATH=."
        program = [self.spec.python, "-m", "cluster_node.programs.snapshots", *args]
        remote = ["timeout", "-k", "5", f"{limit:.0f}", "env", env, *program]
        alive = ["-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3"]
        argv = [*self._ssh(host)[:-1], *alive, host, *remote]
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=limit + 30)

    def persist_snapshot(self, host: str, step: int, size: int = 0) -> Optional[str]:
        """`host` copies its snapshot of the run at `step` into the run's checkpoints (a restart on nodes that
        do not all hold it); the checkpoint's path, or None when that failed. The limit: the size at 50 MB/s
        (EFS's single-stream writes run at ~100 MiB/s), plus a minute, at most 30 minutes."""
        limit = min(1800.0, 60 + size / 50e6)
        try:
            done = self._snapshots(host, limit, "persist", str(self.run), str(step))
            return json.loads(done.stdout.decode().strip().splitlines()[-1])["path"] if done.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError, KeyError, TypeError):
            return None

    def drop_snapshots(self, hosts: Iterable[str]) -> None:
        """The run's snapshots off every node (its RAM), best effort: a run that finished at a checkpoint."""

        def one(host: str) -> None:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                self._snapshots(host, 15, "drop", str(self.run))

        self._each(hosts, one)

    def probe_all(self) -> None:
        """The health probe (probe.sh, written by fab train) on every node of the pool, in parallel."""
        probes = self.run / rundir.PROBES
        probes.mkdir(exist_ok=True)
        for old in probes.iterdir():
            old.unlink()

        def one(host: str) -> None:
            with open(self.run / rundir.PROBE_SH) as script, open(probes / host, "w") as out:
                self._call(self._ssh(host, "bash", "-s"), 30, stdin=script, stdout=out)

        self._each(self.spec.pool, one)

    def then_stop(self, log_path: Path) -> bool:
        """--then-stop: stop the cluster's instances now; also when the log cannot be opened (the failure
        that ended the run may be /data's, and the nodes must stop all the same)."""
        stop = self.spec.then_stop
        if stop is None:
            return True
        env = {**os.environ, **stop.env}
        try:
            log = open(log_path, "a")
        except OSError:
            log = open(os.devnull, "a")
        with log:
            try:
                done = subprocess.run(list(stop.argv), env=env, stdout=log, stderr=subprocess.STDOUT, timeout=300)
                return done.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                return False


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_prctl: Optional[Callable[..., int]]
try:  # loaded before any fork: the child only calls it
    _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: mpirun outlives a killed supervisor, as before
    _prctl = None


def die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGTERM when the process that started it dies, even by SIGKILL
    (prctl(2), PR_SET_PDEATHSIG: the signal survives the exec of a non-setuid program). mpirun takes TERM as
    the end of the job: it ends its ranks and its daemons on the other nodes. A parent already gone before the
    prctl (the child is then reparented) ends the child at once."""

    def preexec() -> None:
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


class Mpirun:
    """The attempt's mpirun, a child of the supervisor; its pid in mpirun.pid for `fab stop --force`. It dies
    with the supervisor (die_with_parent), a SIGKILL included: no run goes on with nobody watching it."""

    def __init__(self, run: Path):
        self.run = run
        self.process: Optional[subprocess.Popen] = None

    def start(self, spec: RunSpec) -> None:
        with open(self.run / rundir.TRAIN_LOG, "ab") as log:
            env = {**os.environ, **spec.process_env}
            self.process = subprocess.Popen(
                spec.argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=die_with_parent(os.getpid()),  # a prctl call only: nothing that takes a lock
            )
        (self.run / rundir.MPIRUN_PID).write_text(f"{self.process.pid}\n")

    def wait(self, timeout: float) -> Optional[int]:
        """mpirun's exit code (as a shell reports it: 128 + signal) once it ended, within `timeout` s."""
        assert self.process is not None
        try:
            code = self.process.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None
        return 128 - code if code < 0 else code

    def end(self) -> int:
        """TERM, up to 5 s, KILL; the exit code."""
        assert self.process is not None
        self.process.terminate()
        code = self.wait(5)
        if code is None:
            self.process.kill()
            code = self.wait(60)
        return 137 if code is None else code
