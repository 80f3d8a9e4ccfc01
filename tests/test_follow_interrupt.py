"""Ctrl-C on `fab logs --follow` / `fab train --follow` (issue 23 §7), on the emulated cluster.

Contract: Invoke's Program.run turns KeyboardInterrupt into a silent `sys.exit(1)` (invoke/program.py,
"Same behavior as Python itself outside of REPL"), so the follower vanished without a word while the
run went on (on AWS, billed). Ctrl-C stops only the follower: it says so in one line, with how to
re-attach and how to stop the run, and leaves the run running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from cluster_harness import Cluster
from conftest import REPO
from runfiles import full_status

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster needs root"),
]
NAME, SUBNET = "tc", "10.213.160.0/24"


@pytest.mark.parametrize("where", ["poll", "ssh-round-trip"])
def test_ctrl_c_on_a_follower_says_the_run_goes_on_and_how_to_reattach_and_stop(tmp_path, where):
    """Issue 32 §8: once, in a loaded `make test`, a Ctrl-C did not end the follower within 30 s. A Ctrl-C
    during an SSH round trip raised KeyboardInterrupt inside Invoke's runner, which then waits for the
    remote command's output to end. Here the round trip is made to hang (the status file a FIFO no one
    writes), so the Ctrl-C lands in it every time, not by luck."""
    cluster = Cluster(NAME, 1, SUBNET, tmp_path)
    cluster.fab("local.up", "--nodes", "1", "--name", NAME, "--subnet", SUBNET, "--replace")
    try:
        run = cluster.run_dir("r1")
        run.mkdir(parents=True)
        (run / "run-status.json").write_text(json.dumps(full_status(state="running")))
        (run / "train.log").write_text("step 1 loss 2.0\n")
        follower = subprocess.Popen(
            ["fab", "logs", "--run", "r1", "--follow"],
            cwd=REPO,
            env=cluster.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert follower.stdout.readline() == "step 1 loss 2.0\n"
        if where == "ssh-round-trip":
            status = run / "run-status.json"
            status.unlink()
            os.mkfifo(status)  # the next poll's read blocks on the node until the end of the test
            deadline = time.monotonic() + 20
            reading = r"cluster_node\.programs\.runs files .*run-status\.json"  # the laptop's read of the run files
            while not cluster.processes(0, reading) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert cluster.processes(0, reading), "the follower's read never started"
        else:
            time.sleep(1.5)  # inside a poll's sleep or a quick SSH round trip
        sent = time.monotonic()
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=30)
        print(f"{where}: ended {time.monotonic() - sent:.2f} s after the Ctrl-C")
        assert time.monotonic() - sent < 5
        assert follower.returncode == 130 and "Traceback" not in err, err  # 128 + SIGINT, as shells report it
        assert err.strip() == (
            "stopped following /data/runs/r1; the run goes on (on AWS, billed): "
            "`fab logs --follow` re-attaches, `fab stop` ends it"
        ), err
        if where == "poll":
            assert json.loads((run / "run-status.json").read_text())["state"] == "running"
    finally:
        cluster.fab("local.down", "--name", NAME, "--yes", check=False)
