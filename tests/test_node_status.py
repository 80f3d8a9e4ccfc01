"""`fab status`'s per-node row (cluster_node.node_status), run as on a node."""

from __future__ import annotations

import subprocess
import sys
import time

from cluster_node import node_status


def test_training_counts_the_trainers_ranks_not_mpirun_or_a_shell_carrying_its_words():
    """`fab status` showed "4 proc" for 3 ranks (issue 23 §13): pgrep counted mpirun's command line
    too. Ranks are python processes running `-m train.train`; the row says "N rank(s)"."""
    before = node_status.training_processes()
    rank = subprocess.Popen([sys.executable, "-", "train.train"], stdin=subprocess.PIPE)
    launcher = subprocess.Popen(["sh", "-c", "sleep 30", "mpirun", "python", "-m", "train.train"])
    try:
        time.sleep(0.3)
        assert node_status.training_processes() == before + 1
    finally:
        for process in (rank, launcher):
            process.kill()
            process.wait()


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
