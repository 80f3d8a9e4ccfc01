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
