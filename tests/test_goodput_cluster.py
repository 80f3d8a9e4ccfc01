"""The goodput account of a real restarted run on the emulated cluster (3 nodes, one killed, as
test_restarts_cluster's lost node): the phases sum to the wall-clock, the steps lost are those after the
last checkpoint, and fab report / fab runs show it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from cluster_harness import start_cluster, stop_cluster
from test_restarts_cluster import RESTARTING, TINY, _beat, _restarts, _wait_for_restart

from cluster_node.protocol import phases
from cluster_node.supervisor import goodput
from clusterops.local import cluster as localcluster

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster needs root")]


def test_a_killed_node_run_accounts_for_its_wall_clock_and_loses_the_steps_after_its_checkpoint(tmp_path):
    cluster = start_cluster("gp", 3, "10.213.140.0/24", tmp_path)
    try:
        cluster.fab("train", "--run", "gp", "--steps", "40", *RESTARTING, "--extra", TINY)
        cluster.wait_for_step("gp", 15)
        reached = _between_checkpoints(cluster, "gp")
        netns = localcluster.LocalSpec(name=cluster.name, nodes=cluster.nodes).netns(2)
        for pid in subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split():
            os.kill(int(pid), signal.SIGKILL)
        _wait_for_restart(cluster, "gp")
        status, _ = cluster.wait_for_end("gp", timeout=120)
        assert status["state"] == "finished", status
        acc = goodput.account(phases.read(cluster.run_dir("gp")))
        [record] = _restarts(cluster, "gp")
        [incident] = acc.incidents
        print("\n".join(goodput.lines(acc)))
        named = sum(v for k, v in acc.phases.items() if k != "unaccounted")
        assert abs(named - acc.wall_s) <= 0.05 * acc.wall_s, acc.phases
        detect = next(m for m in phases.read(cluster.run_dir("gp")) if m.event == "detect")
        assert detect.step >= reached  # the ranks went on between our read and the kill
        assert incident.steps_lost == detect.step - record["resume_step"] > 0
        assert acc.steps_kept == 40 and 0 < acc.goodput < 1
        summary = json.loads((cluster.run_dir("gp") / "summary.json").read_text())["goodput"]  # the supervisor's
        assert summary["goodput"] == round(acc.goodput, 4) and summary["restarts"][0]["steps_lost"] > 0, summary
        report = cluster.fab("report", "--run", "gp").stdout
        assert "goodput " in report and "restart 1 (" in report and (cluster.run_dir("gp") / "goodput.png").exists()
        assert "goodput" in cluster.fab("runs").stdout.splitlines()[0]
    finally:
        stop_cluster(cluster)


def _between_checkpoints(cluster, run: str, every: int = 10, timeout: float = 60) -> int:
    """A step (from the per-step heartbeat) well past a checkpoint, so the kill loses steps: progress is
    written at log steps, which are also checkpoint steps (CI once killed at step 20, losing none)."""
    deadline = time.monotonic() + timeout
    while (step := _beat(cluster, run)[0]) % every not in range(2, every - 2):
        assert time.monotonic() < deadline, f"{run} stuck at step {step}"
        time.sleep(0.05)
    return step
