"""clusterops/launcher.sh run for real on this machine (no cluster): the status it writes is JSON
whatever the failure said, and its start-up deadline ends a run that never reaches a step."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from clusterops import remote

HOSTILE = 'error: bad "quote" \\back\\slash\ttab {"json": 1}'


def _launch(run_dir: Path, command: str, **env: str) -> dict:
    values = {
        "HOSTS": "10.0.0.1",
        "SSH_CONFIG": "/dev/null",
        "ACTIVE_FILE": str(run_dir / "active"),
        "POLL_SECONDS": "1",
        "CLEANUP_SECONDS": "0",
        "PYTHON": sys.executable,
        **env,
    }
    (run_dir / "launch.env").write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    (run_dir / "command.sh").write_text(command)
    # Every node answers: a stand-in ssh (the watchdog's reachability check) that succeeds.
    bin_dir = run_dir / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "ssh").chmod(0o755)
    subprocess.run(
        ["bash", str(REPO / "clusterops" / "launcher.sh"), str(run_dir)],
        timeout=60,
        capture_output=True,
        text=True,
        env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}"),
    )
    return json.loads((run_dir / "run-status.json").read_text())


def test_a_failure_reason_with_quotes_backslashes_and_tabs_is_valid_json(tmp_path):
    quoted = HOSTILE.replace("'", "'\\''")
    status = _launch(tmp_path, f"printf '%s\\n' '{quoted}'; exit 3\n")
    assert status["state"] == "failed" and status["exit_code"] == 3
    assert status["reason"] == HOSTILE


def test_a_run_that_never_reaches_a_step_fails_at_the_start_up_deadline(tmp_path):
    started = time.monotonic()
    status = _launch(tmp_path, "sleep 30\n", START_SECONDS="1")
    assert time.monotonic() - started < 20
    assert status["state"] == "failed" and "no training step within 1 s" in status["reason"]


def test_follow_stops_with_a_clear_message_on_an_unreadable_status():
    class Result:
        def __init__(self, stdout):
            self.stdout, self.stderr, self.exited = stdout, "", 0

    connection = type(
        "C",
        (),
        {
            "host": "head",
            "run": lambda self, c, **k: Result('{"state": "failed", "reason": "bad \\q"}' if "run-status" in c else ""),
        },
    )()
    with pytest.raises(remote.RemoteError, match="run-status.json is not valid JSON"):
        remote.follow_log(connection, "/data/runs/x", timeout=5, poll=0.01)
