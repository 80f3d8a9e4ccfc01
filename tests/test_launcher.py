"""The supervisor (python -m cluster_node.supervisor.loop) run for real on this machine (no cluster): the
status it writes is JSON whatever the failure said, and its start-up deadline ends a run that never reaches a step."""

import io
import json
import subprocess
import time
from pathlib import Path

import pytest
from runfiles import full_status, here
from supervisor_fixture import status, supervise, write_spec
from test_lifecycle import inventory

from cluster_node.protocol.rundir import Progress, RunStatus
from clusterops.nodes import remote
from clusterops.run import lifecycle

HOSTILE = 'error: bad "quote" \\back\\slash\ttab {"json": 1}'


def _launch(run_dir: Path, command: str, **limits: float) -> dict:
    write_spec(run_dir, ["bash", "-c", command], **limits)
    supervise(run_dir)
    return status(run_dir)


def test_a_failure_reason_with_quotes_backslashes_and_tabs_is_valid_json(tmp_path):
    quoted = HOSTILE.replace("'", "'\\''")
    status = _launch(tmp_path, f"printf '%s\\n' '{quoted}'; exit 3\n")
    assert status["state"] == "failed" and status["exit_code"] == 3
    assert status["reason"] == HOSTILE


def test_a_run_that_never_reaches_a_step_fails_at_the_start_up_deadline(tmp_path):
    started = time.monotonic()
    status = _launch(tmp_path, "sleep 30\n", start=1)
    assert time.monotonic() - started < 20
    assert status["state"] == "failed" and "no training step within 1 s" in status["reason"]


class LocalShell:
    """A connection whose commands run in this machine's bash (the head node's shell, here)."""

    host = "head"

    def run(self, command, **_):
        result = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
        result.exited = result.returncode  # type: ignore[attr-defined]
        return result


def test_follow_stops_with_a_clear_message_on_an_unreadable_status(tmp_path):
    (tmp_path / "run-status.json").write_text('{"state": "failed", "reason": "bad \\q"}')
    with pytest.raises(remote.RemoteError, match="run-status.json is not valid JSON"):
        lifecycle.follow_log(LocalShell(), here(inventory()), str(tmp_path), timeout=5, poll=0.01)


def test_follow_prints_the_log_as_it_grows_and_reports_progress_until_the_run_ends(tmp_path):
    (tmp_path / "run-status.json").write_text(json.dumps(full_status(state="running")))
    (tmp_path / "progress.json").write_text('{"step": 3}')
    (tmp_path / "train.log").write_text("step 1\n")
    seen, out = [], io.StringIO()

    def on_progress(progress):
        seen.append(progress)
        if len(seen) == 2:  # the run writes more, then ends
            with open(tmp_path / "train.log", "a") as log:
                log.write("step 2 \u00e9\n")
            (tmp_path / "run-status.json").write_text(json.dumps(full_status(state="finished")))

    inv = here(inventory())
    status = lifecycle.follow_log(
        LocalShell(), inv, str(tmp_path), out=out, timeout=5, poll=0.01, on_progress=on_progress
    )
    assert status == RunStatus.from_json(full_status(state="finished")) and seen[0] == Progress(step=3)
    assert out.getvalue() == "step 1\nstep 2 \u00e9\n"  # each byte once, across polls
