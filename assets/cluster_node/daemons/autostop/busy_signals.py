"""What one node sees that says someone uses the cluster: the watchdog's signals (README "Cost safety").

* a training step advancing (the newest unfinished run's progress.json);
* a run launched by `fab train` (runs/.active names it) that has no step yet, for the launcher's
  own start-up limit (START_SECONDS in its launch.env) plus a minute;
* GPU utilisation above 5%, or a process on a GPU, whether or not a run is marked (not while a
  marked run's step is stuck: a hung collective keeps GPUs at 100%; the launcher ends that run);
* a data set being prepared (prepare.py keeps a marker fresh under /data/.cluster/busy/);
* a terminal with input within ACTIVITY_WINDOW_S (the tty's access time, as `w` shows IDLE);
* an SSH connection to the container's sshd that carried traffic from its client within
  ACTIVITY_WINDOW_S (VS Code Remote, Jupyter or port forwards have no terminal), but not one of fab's
  (each fab command leaves its connection's SSH_CONNECTION in FAB_SSH_MARKS: clusterops/nodes/remote.py).
Terminals and connections are the interactive signals (`interactive`): alone, they count for a
limited time (watchdog.INTERACTIVE_MAX_S).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from cluster_node import tools
from cluster_node.protocol import clusterdir, rundir

GPU_BUSY_PERCENT = 5.0
STEP_WINDOW_S = 15 * 60  # a step within this is "advancing" (the launcher ends runs stalled for 10 min)
MARKER_FRESH_S = 5 * 60  # prepare.py refreshes its marker every minute
START_DEFAULT_S = 900  # the launcher's START_SECONDS when launch.env does not say
START_GRACE_S = 60  # the launcher polls every 5 s and then needs a moment to write its end
PROC_STAT = Path("/proc/stat")
CLOCK_SKEW_S = 60  # EFS's modification times against this node's clock (a boot takes minutes before a launch)
ACTIVITY_WINDOW_S = 30 * 60  # a terminal or an SSH connection counts for this long after its last activity
# Bytes from an SSH client between two samples (a minute) that count as use. sshd's keepalive
# (ClientAliveInterval 10 in sshd_config) brings ~75 bytes a minute from an idle `ssh -N` client (measured:
# 224 bytes in 3 min on OpenSSH here); a terminal keystroke is ~40 bytes, an editor's file save or a notebook
# cell's output several KB.
CONNECTION_FLOOR_BYTES = 4096
TERMINAL, CONNECTION = "terminal pts/", "SSH connection from "  # how the interactive reasons begin
MARK_STALE_S = 10 * 60  # a fab mark whose connection is gone is removed after this


def interactive(reason: str) -> bool:
    """A terminal's or an SSH connection's reason, this node's or another's ("nodeN: ...")."""
    return reason.split(": ", 1)[-1].startswith((TERMINAL, CONNECTION)) or reason.startswith((TERMINAL, CONNECTION))


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile
        return 0.0


def latest_progress(data_dir: Path, now: float) -> tuple[Optional[int], Optional[float]]:
    """(step, age in seconds) of the newest run's progress.json; (None, None) without a run going."""
    progress = max((data_dir / rundir.RUNS).glob(f"*/{rundir.PROGRESS}"), key=_mtime, default=None)
    if progress is None:
        return None, None
    try:
        values = json.loads(progress.read_text())
        if values.get("ended"):
            return None, None
        return int(values["step"]), max(0.0, now - _mtime(progress))
    except (ValueError, KeyError, TypeError, OSError):
        return None, None


def _start_limit(run: Path) -> float:
    """The supervisor's start limit for this run (its spec.json, limits.start), else its default."""
    try:
        return float(json.loads((run / rundir.SPEC).read_text())["limits"]["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return START_DEFAULT_S


def boot_time(stat: Path = PROC_STAT) -> Optional[float]:
    """When this kernel booted (proc(5), /proc/stat `btime`; a container sees its host's), else None."""
    try:
        return float(next(line.split()[1] for line in stat.read_text().splitlines() if line.startswith("btime ")))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def launched_run(data_dir: Path, now: float) -> tuple[bool, Optional[str]]:
    """(a run is marked live, why it is busy while it starts). `fab train` writes runs/.active before
    it starts the launcher; the launcher writes run-status.json ("running", later its end), recreates
    RUN_DIR/ranks at each attempt's start and removes .active when the run is over. An attempt started
    before this node booted left no rank here (a stop or a Spot interruption ended them; a launcher that
    lived on ends or restarts it): not live, so this node's GPU work counts."""
    active = rundir.active_file(data_dir)
    try:
        named = active.read_text().strip()
    except OSError:
        return False, None
    run = rundir.run_dir(data_dir, Path(named).name)
    if not named or not run.is_dir():
        return False, None
    try:
        state = json.loads((run / rundir.RUN_STATUS).read_text()).get("state")
    except (OSError, ValueError):
        state = rundir.RunState.RUNNING  # fab train starts the launcher right after writing .active
    if state != rundir.RunState.RUNNING:
        return False, None
    started = max(_mtime(active), _mtime(run / rundir.RANKS))
    booted = boot_time()
    if booted is not None and started < booted - CLOCK_SKEW_S:
        return False, None
    if _mtime(run / rundir.PROGRESS) >= started:
        return True, None  # a step of this attempt: the step signal speaks
    age = now - started
    if age > _start_limit(run) + START_GRACE_S:
        return True, None  # past the launcher's own limit: it ends the attempt, this is no use
    return True, f"run {run.name} launched {age / 60:.0f} min ago, no step yet"


def _nvidia_smi(*query: str) -> list[list[str]]:
    code, out = tools.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], timeout=30)
    if code != 0:
        return []
    return [[v.strip() for v in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_readings() -> tuple[Optional[float], Optional[float]]:
    """(utilisation %, memory used %), each the maximum over the GPUs; (None, None) without GPUs."""
    rows = [
        [float(v) for v in row]
        for row in _nvidia_smi("--query-gpu=utilization.gpu,memory.used,memory.total")
        if len(row) == 3 and all(v.replace(".", "", 1).isdigit() for v in row)
    ]
    if not rows:
        return None, None
    return max(r[0] for r in rows), max(100 * r[1] / r[2] for r in rows if r[2] > 0)


def gpu_processes() -> tuple[int, ...]:
    """Process ids with a context on a GPU (nvidia-smi's compute apps); () without GPUs."""
    return tuple(sorted({int(row[0]) for row in _nvidia_smi("--query-compute-apps=pid") if row[0].isdigit()}))


def preparing(data_dir: Path, now: float) -> tuple[str, ...]:
    """Data-preparation markers refreshed in the last MARKER_FRESH_S (a killed prepare.py's goes stale)."""
    found = []
    for marker in sorted((data_dir / clusterdir.CLUSTER / clusterdir.BUSY_DIR).glob("*.json")):
        try:
            if now - _mtime(marker) <= MARKER_FRESH_S:
                found.append(json.loads(marker.read_text()).get("what", marker.stem))
        except (OSError, ValueError):
            continue
    return tuple(found)


def terminals(now: float, pts: Path = Path("/dev/pts"), window: float = ACTIVITY_WINDOW_S) -> tuple[str, ...]:
    """Terminals with input in the last `window` seconds. The kernel sets a tty's access time when a
    program reads input from it and its modification time on output (drivers/tty/tty_io.c,
    tty_update_time, 8 s granularity); `w` shows now - atime as IDLE. Output alone (top, a
    log tail) is not use. Every pty of the container counts: sshd sessions, docker exec -t, tmux."""
    found = []
    for tty in sorted(pts.glob("[0-9]*")):
        try:
            idle = now - tty.stat().st_atime
        except OSError:  # closed meanwhile
            continue
        if idle <= window:
            found.append(f"{TERMINAL}{tty.name} (input {max(idle, 0) / 60:.0f} min ago)")
    return tuple(found)


def ssh_connections(port: int) -> dict[str, int]:
    """Established TCP connections to `port` on this host -> bytes received from the peer so far
    (tcp_info's tcpi_bytes_received, which `ss -i` prints as bytes_received; absent while 0)."""
    code, out = tools.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"], timeout=30)
    if code != 0:
        return {}
    found: dict[str, int] = {}
    key = None
    for line in out.splitlines():
        if line and not line[0].isspace():  # "Recv-Q Send-Q Local:Port Peer:Port"
            fields = line.split()
            key = f"{fields[-1]}>{fields[-2]}" if len(fields) >= 2 else None
            if key:
                found[key] = 0
        elif key:
            for field in line.split():
                if field.startswith("bytes_received:"):
                    found[key] = int(field.split(":", 1)[1])
    return found


def _endpoint(text: str) -> tuple[str, str]:
    """("ip", "port") from ss's "1.2.3.4:5" or "[::ffff:1.2.3.4]:5"; sshd writes a mapped address as IPv4."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    return host.removeprefix("::ffff:"), port


def fab_connections(marks: Path, readings: dict[str, int], now: Optional[float] = None) -> set[str]:
    """The keys of `readings` (ssh_connections) that fab marked: a file named by the session's
    SSH_CONNECTION ("client_ip client_port server_ip server_port"). A mark whose connection is gone
    is removed once older than MARK_STALE_S (a new connection's mark may precede its ss line)."""
    now = time.time() if now is None else now
    by_peer = {}
    for key in readings:
        peer, _, local = key.partition(">")
        by_peer[(*_endpoint(peer), _endpoint(local)[1])] = key
    found: set[str] = set()
    try:
        marked = list(marks.iterdir())
    except OSError:
        return found
    for mark in marked:
        fields = mark.name.split()
        key = by_peer.get((fields[0], fields[1], fields[3]), "") if len(fields) == 4 else ""
        if key:
            found.add(key)
        elif now - _mtime(mark) > MARK_STALE_S:
            mark.unlink(missing_ok=True)
    return found


def connection_activity(
    now: float, readings: dict[str, int], memory: dict, window: float = ACTIVITY_WINDOW_S
) -> tuple[tuple[str, ...], dict]:
    """SSH connections that carried more than CONNECTION_FLOOR_BYTES from their client between two
    samples within `window` (a new connection counts from its start). memory: what the last call
    returned (key -> [bytes received, last active time]); the caller keeps it across restarts."""
    found, kept = [], {}
    for key, received in sorted(readings.items()):
        before = memory.get(key)
        active_at = now if before is None or received - before[0] >= CONNECTION_FLOOR_BYTES else before[1]
        kept[key] = [received, active_at]
        if now - active_at <= window:
            found.append(f"{CONNECTION}{key.split('>')[0]} (traffic {(now - active_at) / 60:.0f} min ago)")
    return tuple(found), kept


def gpu_activity(
    now: float, pids: tuple[int, ...], util: Optional[float], memory: dict, window: float = ACTIVITY_WINDOW_S
) -> tuple[int, dict]:
    """How many GPU processes count: all of them while the GPU was busy, or a new process appeared,
    within `window`; none after (a notebook kernel that holds a GPU and does nothing)."""
    active_at = float(memory.get("active_at", now))
    if (util is not None and util > GPU_BUSY_PERCENT) or set(pids) - set(memory.get("pids", [])):
        active_at = now
    counting = len(pids) if now - active_at <= window else 0
    return counting, {"pids": list(pids), "active_at": active_at}
