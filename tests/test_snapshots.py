"""What a node holds in memory for a restart, and its copy to /data (cluster_node.programs.snapshots, issue 30):
the real program, as the supervisor runs it over ssh, on files laid out as train.snapshot writes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import tool_env

from cluster_node.programs import probe, snapshots
from cluster_node.protocol import rundir


def _node(tmp_path, run: str, *steps: int, temp: bool = False):
    held = tmp_path / "shm" / run
    held.mkdir(parents=True)
    for step in steps:
        (held / rundir.SNAPSHOT.format(step=step)).write_bytes(b"state at %d" % step)
    if temp:  # a writer killed mid-write: its temp file, no step name
        (held / f".{rundir.SNAPSHOT.format(step=99)}.tmp.4242").write_bytes(b"half")
    return tmp_path / "shm"


def _program(*args: str, root) -> subprocess.CompletedProcess:
    env = tool_env(**{rundir.SNAPSHOT_DIR_ENV: str(root)})
    command = [sys.executable, "-m", "cluster_node.programs.snapshots", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


def test_a_node_reports_its_newest_complete_snapshot_per_run_and_the_probe_carries_it(tmp_path, monkeypatch):
    root = _node(tmp_path, "base", 400, 412, temp=True)
    _node(tmp_path, "other", 7)
    expected = {"base": {"step": 412, "bytes": 12}, "other": {"step": 7, "bytes": 10}}
    assert snapshots.held(root) == expected
    assert json.loads(_program("held", root=root).stdout) == expected
    assert snapshots.held(tmp_path / "none") == {}
    monkeypatch.setenv(rundir.SNAPSHOT_DIR_ENV, str(root))
    assert probe.facts(tmp_path)["snapshots"] == expected


def test_persist_copies_the_snapshot_into_the_runs_checkpoints_atomically(tmp_path):
    root = _node(tmp_path, "base", 412)
    run = tmp_path / "data" / "runs" / "base"
    done = _program("persist", str(run), "412", root=root)
    assert done.returncode == 0, done.stderr
    copied = json.loads(done.stdout)
    assert copied["path"] == str(rundir.checkpoint(run, 412)) and copied["copied"] and copied["bytes"] == 12
    assert rundir.checkpoint(run, 412).read_bytes() == b"state at 412"
    assert [p.name for p in (run / rundir.CHECKPOINTS).iterdir()] == ["step_00000412.pt"]  # no temp file left
    # The trainer's own checkpoint of that step is the same state: kept, not copied over.
    rundir.checkpoint(run, 412).write_bytes(b"the trainer's")
    again = json.loads(_program("persist", str(run), "412", root=root).stdout)
    assert not again["copied"] and rundir.checkpoint(run, 412).read_bytes() == b"the trainer's"


def test_persist_of_a_snapshot_the_node_does_not_hold_is_one_line_and_writes_nothing(tmp_path):
    root = _node(tmp_path, "base", 400)
    run = tmp_path / "data" / "runs" / "base"
    done = _program("persist", str(run), "412", root=root)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("error: no snapshot of base at step 412 on this node")
    assert done.stderr.count("\n") == 1
    assert not (run / rundir.CHECKPOINTS).exists()


def test_drop_frees_the_nodes_memory_of_one_run_only(tmp_path):
    root = _node(tmp_path, "base", 412, temp=True)
    _node(tmp_path, "other", 7)
    done = _program("drop", str(tmp_path / "data" / "runs" / "base"), root=root)
    assert done.returncode == 0 and json.loads(done.stdout) == {"dropped": 2}
    assert not (root / "base").exists() and snapshots.held(root) == {"other": {"step": 7, "bytes": 10}}
    assert json.loads(_program("drop", str(tmp_path / "data" / "runs" / "base"), root=root).stdout) == {"dropped": 0}


LOCAL_SSH = """#!/bin/bash
# ssh [-F CONFIG] [-o X]... HOST COMMAND...: the command runs here, as sshd would run it on HOST; its options
# are recorded (the supervisor must keep a dead holder from hanging the copy).
echo "$@" >> "$SSH_LOG"
while [[ $1 == -* ]]; do shift 2; done
shift
exec "$@"
"""


def test_the_supervisors_copy_runs_the_program_on_the_holder_under_a_time_limit(tmp_path, monkeypatch):
    """cluster_node.supervisor.nodes.Nodes.persist_snapshot's real command line, through an ssh that runs it
    here: `timeout` ends the copy on the holder too, ServerAlive notices a holder that died mid-copy."""
    from supervisor_fixture import write_spec

    from cluster_node.supervisor.nodes import Nodes

    root = _node(tmp_path, "run", 412)
    run = tmp_path / "run"
    run.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(LOCAL_SSH)
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SSH_LOG", str(tmp_path / "ssh.log"))
    monkeypatch.setenv(rundir.SNAPSHOT_DIR_ENV, str(root))
    nodes = Nodes(run, write_spec(run, ["train.py"], ["10.0.0.1", "10.0.0.2"]))
    assert nodes.persist_snapshot("10.0.0.2", 412, size=12) == str(rundir.checkpoint(run, 412))
    assert rundir.checkpoint(run, 412).read_bytes() == b"state at 412"
    assert nodes.persist_snapshot("10.0.0.2", 500) is None  # not held there: the plan falls back
    sent = (tmp_path / "ssh.log").read_text().splitlines()[0]
    assert "-o ServerAliveInterval=10 -o ServerAliveCountMax=3 10.0.0.2 timeout -k 5 60 env PYTHONPATH=" in sent
    nodes.drop_snapshots(["10.0.0.1", "10.0.0.2"])
    assert snapshots.held(root) == {}
