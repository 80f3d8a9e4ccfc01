"""Spot interruption watcher, one per Spot node (the container's entrypoint starts it when SPOT=true).

Every few seconds it reads the instance-metadata item spot/instance-action through IMDSv2: absent
(HTTP 404) while EC2 plans nothing; {"action": "stop"|"terminate", "time": "2017-09-18T08:22:00Z"}
about two minutes before EC2 stops or terminates the node (EC2 suggests polling every 5 seconds).
On a notice it asks the active run (named by /data/runs/.active) to checkpoint at once, through the
file `fab stop` uses: RUN_DIR/STOP, here with the first word "now" so the trainer skips its eval;
records the interruption in RUN_DIR/interruptions.json (resume the run with `fab train --run NAME`);
and logs it, also into the run's train.log. Each notice is acted on once.

    NODE_RANK=1 python -m cluster_node.daemons.spotwatch [--data /data] [--interval 5]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from cluster_node.daemons.autostop.watchdog import where_am_i
from cluster_node.daemons.imds import IMDS_URL, imds_get, instance_identity
from cluster_node.protocol import rundir, spec

ACTION_PATH = "/latest/meta-data/spot/instance-action"
POLL_S = 5.0
URGENT_STOP = rundir.URGENT_STOP_WORD  # the trainer: a STOP starting with it checkpoints without the eval


@dataclass(frozen=True)
class Notice:
    action: str  # stop, terminate (hibernate gives no two-minute notice)
    time: str  # when EC2 will act, UTC


def instance_action(base: str = IMDS_URL, timeout: float = 2.0) -> Optional[Notice]:
    """The planned interruption, None when there is none (404). Raises OSError or ValueError when the
    metadata service does not answer or answers something else."""
    try:
        item = json.loads(imds_get(ACTION_PATH, base, timeout))
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise
    if not isinstance(item, dict) or "action" not in item:
        raise ValueError(f"unexpected {ACTION_PATH}: {item!r}")
    return Notice(str(item["action"]), str(item.get("time", "")))


def active_run(data_dir: Path) -> Optional[Path]:
    """The run directory runs/.active names (the head node writes its own path into it; the run is
    found by name under data_dir, so this works wherever /data is mounted)."""
    try:
        named = rundir.active_file(data_dir).read_text().strip()
    except OSError:
        return None
    run = rundir.run_dir(data_dir, Path(named).name) if named else None
    return run if run is not None and run.is_dir() else None


LOCK_WAIT_S = 5.0  # for the lock below: a client lost while holding it keeps it until its NFSv4 lease expires


def record(run_dir: Path, entry: dict, wait: Optional[float] = None) -> list[dict]:
    """Append to RUN_DIR/interruptions.json under a lock (nodes may be noticed together; EFS
    supports POSIX locks) and replace the file atomically. Returns all entries. OSError when the lock is
    not had within `wait` seconds (the STOP goes out all the same: handle)."""
    path = run_dir / rundir.INTERRUPTIONS
    with open(run_dir / rundir.INTERRUPTIONS_LOCK, "w") as lock:
        _lock(lock, LOCK_WAIT_S if wait is None else wait)
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            entries = []
        entries.append(entry)
        tmp = path.with_name(f".interruptions.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, path)
    return entries


def _lock(handle, wait: float) -> None:
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


def _step(run_dir: Path) -> Optional[int]:
    try:
        return int(json.loads((run_dir / rundir.PROGRESS).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def handle(
    notice: Notice, data_dir: Path, rank: str, instance_id: Optional[str], now: float, host: Optional[str] = None
) -> str:
    """Checkpoint the active run now and record why (`host`: this node's private address, the name the
    run's hostfile knows it by; a launcher with restarts left drops it); returns the log line."""
    where = f"node{rank}" + (f" ({instance_id})" if instance_id else "")
    what = f"spot: {where} will {notice.action} at {notice.time or 'an unknown time'}"
    run = active_run(data_dir)
    if run is None:
        return f"{what}; no run going"
    step = _step(run)
    stops = _in_the_run(run, host)
    entry = {
        "node": int(rank) if rank.isdigit() else rank,
        "instance_id": instance_id,
        "host": host,
        "action": notice.action,
        "action_time": notice.time,
        "step": step,
        "noticed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
    }
    try:  # the record first: a supervisor that finds the STOP finds whose notice it is (loop.took_a_workers_notice)
        record(run, entry)
    finally:  # the STOP even when the record failed: the checkpoint comes first
        if stops:  # appended: a `fab stop` or another node's notice already there stays
            with open(run / rundir.STOP, "a") as stop:
                stop.write(f"{URGENT_STOP}: {what}\n")
    line = f"{what}; asked {run.name} to checkpoint now (last step {step}); resume: fab train --run {run.name}"
    if not stops:  # recorded all the same: a later restart leaves the node out
        line = f"{what}; not in {run.name}'s current attempt: the run goes on without it"
    with open(run / rundir.TRAIN_LOG, "a") as log:
        log.write(f"{time.strftime('%FT%TZ', time.gmtime(now))} {line}\n")
    return line


def _in_the_run(run: Path, host: Optional[str]) -> bool:
    """Whether a notice for `host` ends the run's current attempt: a node among its ranks or the supervisor's own;
    not a node `--nodes`/`--exclude` or a restart left out (it trains nothing). Unknown (no spec, no address): yes."""
    try:
        current = spec.read(run)
    except (OSError, ValueError, KeyError, TypeError):
        return True
    if host is None or not current.hosts:
        return True
    return host in current.hosts or host == current.supervisor_host


class Watcher:
    """One poll at a time; a notice already acted on is not acted on again."""

    def __init__(
        self,
        data_dir: Path,
        rank: str,
        instance_id: Optional[str],
        read: Callable[[], Optional[Notice]] = instance_action,
        host: Optional[str] = None,
        identify: Callable[[], Optional[str]] = lambda: None,
    ):
        self.data_dir, self.rank, self.instance_id, self.read = data_dir, rank, instance_id, read
        self.host, self.identify = host, identify
        self.handled: Optional[Notice] = None

    def poll(self, now: float) -> Optional[str]:
        # An IMDS that did not answer at start: ask again, else a notice on the head node would be
        # recorded without the host the supervisor recognises itself by.
        self.host = self.host or self.identify()
        notice = self.read()
        if notice is None or notice == self.handled:
            return None
        line = handle(notice, self.data_dir, self.rank, self.instance_id, now, self.host)
        self.handled = notice  # only once handled: a failed attempt is retried at the next poll
        return line


def watch(watcher: Watcher, interval: float, polls: Optional[int] = None) -> None:
    """Poll every `interval` seconds (forever, or `polls` times); a failing poll is logged once."""
    failing = None
    while polls is None or polls > 0:
        started = time.time()
        try:
            line, failing = watcher.poll(started), None
            if line:
                print(f"{time.strftime('%FT%TZ', time.gmtime(started))} {line}", flush=True)
        except (OSError, ValueError) as error:
            if str(error) != failing:
                print(
                    f"spot: a poll failed (instance metadata or the run's records on /data: {error}); still polling",
                    flush=True,
                )
            failing = str(error)
        polls = None if polls is None else polls - 1
        time.sleep(max(0.0, interval - (time.time() - started)))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="/data")
    parser.add_argument("--interval", type=float, default=POLL_S, help="seconds between polls")
    args = parser.parse_args(argv)
    _, instance_id = where_am_i(dict(os.environ))
    # The identity document's privateIp: the address fab train's hostfile names this node by.
    host = os.environ.get("PRIVATE_IP")
    identify = lambda: instance_identity().get("privateIp")  # noqa: E731
    print(f"spot: watching {IMDS_URL}{ACTION_PATH} every {args.interval:g} s", flush=True)
    rank = os.environ.get("NODE_RANK", "0")
    watch(Watcher(Path(args.data), rank, instance_id, host=host, identify=identify), args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
