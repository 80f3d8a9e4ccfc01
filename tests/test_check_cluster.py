"""`fab check` and `fab train`'s health refusal on 2 emulated nodes: all ok with a link matrix, then
node1's /data made read-only in its own mount namespace: check names it and exits non-zero, train
refuses it, `train --exclude 1` starts on node0."""

import json
import os
import re
import subprocess

import pytest
from test_local_cluster import QUICK, Cluster, _stop

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster needs root")]


def _read_only_data(cluster: Cluster, rank: int) -> None:
    """Remount /data read-only in one node's mount namespace only (its sshd's)."""
    sshd = cluster.processes(rank, r"sshd")[0]
    subprocess.run(["nsenter", "-t", str(sshd), "-m", "mount", "-o", "remount,bind,ro", "/data"], check=True)


def test_check_json_then_a_bad_node_is_named_refused_and_excluded(tmp_path):
    cluster = Cluster("hc", 2, "10.213.121.0/24", tmp_path)
    try:
        cluster.fab("local.up", "--nodes", "2", "--name", "hc", "--subnet", cluster.subnet, "--replace")
        cluster.fab("data", "--extra", "--train 500 --valid 16 --test 8 --vocab 200")
        # The per-node part as JSON (the link part, link.json and the transport: the 3-node check test).
        doc = json.loads(cluster.fab("check", "--json", "--quick").stdout)
        assert doc["fit_to_train"] is True and [n["verdict"] for n in doc["nodes"]] == ["ok", "ok"]
        assert doc["problems"] == [] and doc["link"] is None
        assert doc["nodes"][1]["notes"] == ["GPU checks not available (no nvidia-smi: CPU node)"]
        assert doc["nodes"][1]["details"]["hostname"] == "node1" and doc["nodes"][1]["details"]["torch"].startswith(
            "2."
        )

        _read_only_data(cluster, 1)
        bad = cluster.fab("check", "--quick", check=False)
        assert bad.returncode == 1
        assert re.search(r"^node1\s+bad\s.*/data is not writable", bad.stdout, re.M), bad.stdout
        assert bad.stderr.strip() == "error: not fit to train: node1 (/data is not writable)"

        refused = cluster.fab("train", "--steps", "2", "--run", "refused", check=False)
        assert refused.returncode == 1 and not cluster.run_dir("refused").exists()
        assert refused.stderr.strip().splitlines() == [
            "error: node1 is bad (/data is not writable): fix it, or train without it with `fab train --exclude 1`"
        ]
        started = cluster.fab("train", "--exclude", "1", "--steps", "2", "--run", "without1", "--extra", QUICK)
        assert "started without1" in started.stdout and "on 1 node(s)" in started.stdout
        assert (cluster.run_dir("without1") / "hostfile").read_text() == "10.213.121.10 slots=1\n"
        status, _ = cluster.wait_for_end("without1", timeout=60)
        assert status["state"] == "finished", status
    finally:
        _stop(cluster)
