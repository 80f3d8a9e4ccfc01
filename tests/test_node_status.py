"""`fab status`'s per-node row (cluster_node.programs.node_status), run as on a node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, tool_env

from cluster_node.programs import node_status


def test_training_counts_the_trainers_ranks_not_mpirun_or_a_shell_carrying_its_words():
    """`fab status` showed "4 proc" for 3 ranks (issue 23 §13): pgrep counted mpirun's command line
    too. Ranks are python processes running `-m train.train`; the row says "N rank(s)"."""
    rank = subprocess.Popen([sys.executable, "-", "train.train"], stdin=subprocess.PIPE)
    launcher = subprocess.Popen(["sh", "-c", "sleep 30", "mpirun", "python", "-m", "train.train"])
    try:
        time.sleep(0.3)
        # By pid, not a count before and after: other tests' ranks come and go meanwhile (a CI run's did).
        counted = node_status.training_pids()
        assert rank.pid in counted and launcher.pid not in counted
    finally:
        for process in (rank, launcher):
            process.kill()
            process.wait()


FORKING_RANK = "import os, time; os.fork(); time.sleep(60)"  # a rank and its DataLoader worker (a fork)


@pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace needs root")
def test_a_node_counts_its_own_ranks_not_their_workers_or_another_nodes(tmp_path):
    """Issue 32 §6: every `train.train` process in /proc was a rank: DataLoader workers, and on the
    emulated cluster every node's (a node outside the run showed "6 rank(s)"). Here one rank with a forked
    worker in this node's namespace, and another node's rank in the machine's own namespace."""
    netns = f"gcs-status-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    inside = ["ip", "netns", "exec", netns]
    started = []
    try:
        started.append(subprocess.Popen([*inside, sys.executable, "-c", FORKING_RANK, "train.train"]))
        started.append(subprocess.Popen([sys.executable, "-c", FORKING_RANK, "train.train"]))  # another node's
        time.sleep(1)
        status = subprocess.run(
            [
                *inside,
                sys.executable,
                "-m",
                "cluster_node.programs.node_status",
                "--data",
                str(tmp_path),
                "--name",
                "node0",
            ],
            capture_output=True,
            text=True,
            env=tool_env(PYTHONPATH=str(REPO / "assets")),
            check=True,
        )
        assert json.loads(status.stdout)["training"] == 1
    finally:
        for process in started:
            subprocess.run(["pkill", "-KILL", "-P", str(process.pid)], check=False)  # its fork, by parent id
            process.kill()
            process.wait()
        subprocess.run(["ip", "netns", "del", netns], check=False)


def test_the_status_row_shows_the_deploy_total_and_a_line_its_timeline(tmp_path):
    """Issue 22 §6: `fab status` shows each node's deploy, per step and in total, from the timeline the
    bootstrap copied to DATA/.cluster/deploy/nodeN (a line cut short is skipped, a failed step says so)."""
    from clusterops import terminal

    deploy = tmp_path / ".cluster" / "deploy"
    deploy.mkdir(parents=True)
    t0 = 1_700_000_000.0
    (deploy / "node1").write_text(
        f"docker {t0} {t0 + 2.25}\nmount-efs {t0 + 2.25} {t0 + 4}\npull-image {t0 + 4} {t0 + 184}\n"
        f"build-image {t0 + 184} {t0 + 412.5}\nready {t0 + 412.5} {t0 + 413} failed\nstart-cont"
    )
    found = node_status.status(tmp_path, "node1")
    assert found["deploy"] == {
        "started": t0,
        "total_s": 413.0,
        "steps": [
            ["docker", 2.25, True],
            ["mount-efs", 1.75, True],
            ["pull-image", 180.0, True],
            ["build-image", 228.5, True],
            ["ready", 0.5, False],
        ],
    }
    assert node_status.status(tmp_path, "node0")["deploy"] is None
    row = terminal.status_row(found)
    assert row["deploy"] == "6m53s" and row["bootstrap"] == "no"
    assert terminal.deploy_line("node1", found["deploy"]) == (
        "node1 deploy 6m53s from 2023-11-14T22:13:20Z: docker 2.2s, mount-efs 1.8s, pull-image 3m00s, "
        "build-image 3m48s, ready 0.5s FAILED"
    )
    assert terminal.status_row({**found, "deploy": None})["deploy"] == "-"
