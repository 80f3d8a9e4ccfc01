"""`fab check` and `fab train`'s health refusal on 2 emulated nodes: all ok with a link matrix; an
EFA cluster whose check found sockets (several TCP streams per pair, the link from the all-reduce),
refused and then allowed with --allow-tcp; then node1's /data made read-only in its own mount
namespace: check names it and exits non-zero, train refuses it, `train --exclude 1` starts on node0."""

import json
import os
import re
import subprocess

import pytest
from cluster_harness import QUICK, Cluster, stop_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster needs root")]


def _read_only_data(cluster: Cluster, rank: int) -> None:
    """Remount /data read-only in one node's mount namespace only (its sshd's)."""
    sshd = cluster.processes(rank, r"sshd")[0]
    subprocess.run(["nsenter", "-t", str(sshd), "-m", "mount", "-o", "remount,bind,ro", "/data"], check=True)


def _efa_expected_but_sockets_found(cluster: Cluster) -> None:
    """The inventory says EFA; the emulated nodes have none (gloo on CPU, as a missing aws-ofi-nccl leaves
    NCCL on sockets). fab check measures every pair over 4 TCP streams (EC2 caps one flow at 5 Gbit/s;
    NCCL opens NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD per peer), takes the all-reduce bus bandwidth
    as the link (EFA's traffic is not TCP), keeps its transport verdict on /data; fab train then refuses
    in one line, and --allow-tcp trains."""
    saved = json.loads(cluster.inventory.read_text())
    cluster.inventory.write_text(json.dumps({**saved, "extra": {**saved.get("extra", {}), "efa_cards": 1}}))
    try:
        check = cluster.fab("check", "--streams", "4", "--mb", "8", "--seconds", "1", check=False)
        assert check.returncode == 1 and "not EFA" in check.stderr, check.stdout + check.stderr
        link = json.loads((cluster.shared / ".cluster" / "link.json").read_text())
        assert [p["streams"] for p in link["pairs"]] == [4, 4] and link["streams"] == 4
        assert link["link_gbit"] == link["allreduce_busbw_gbit"] > 0 and "EFA" in link["link_source"]
        assert "TCP streams per pair: 4" in check.stdout
        verdict = json.loads((cluster.shared / ".cluster" / "transport.json").read_text())
        assert verdict["expect_efa"] is True and verdict["not_efa"] == ["node0", "node1"]

        refused = cluster.fab("train", "--steps", "2", "--run", "over-tcp", check=False)
        assert refused.returncode == 1 and not cluster.run_dir("over-tcp").exists()
        (line,) = refused.stderr.strip().splitlines()
        assert "found NCCL on gloo (no NCCL), not EFA, on node0, node1" in line and "--allow-tcp" in line
        allowed = cluster.fab("train", "--steps", "2", "--run", "over-tcp", "--allow-tcp", "--extra", QUICK)
        assert "started over-tcp" in allowed.stdout
        assert cluster.wait_for_end("over-tcp", timeout=90)[0]["state"] == "finished"
    finally:
        cluster.inventory.write_text(json.dumps(saved))
        (cluster.shared / ".cluster" / "transport.json").unlink(missing_ok=True)


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

        _efa_expected_but_sockets_found(cluster)

        _read_only_data(cluster, 1)
        bad = cluster.fab("check", "--quick", check=False)
        assert bad.returncode == 1
        assert re.search(r"^node1\s+bad\s.*/data is not writable", bad.stdout, re.M), bad.stdout
        assert bad.stderr.strip().splitlines()[-1] == "error: not fit to train: node1 (/data is not writable)"

        refused = cluster.fab("train", "--steps", "2", "--run", "refused", check=False)
        assert refused.returncode == 1 and not cluster.run_dir("refused").exists()
        assert refused.stderr.strip().splitlines() == [
            "error: node1 is bad (/data is not writable): fix it, or train without it with `fab train --exclude 1`"
        ]
        started = cluster.fab("train", "--exclude", "1", "--steps", "2", "--run", "without1", "--extra", QUICK)
        assert "started without1" in started.stdout and "on 1 node(s)" in started.stdout
        assert json.loads((cluster.run_dir("without1") / "spec.json").read_text())["hosts"] == ["10.213.121.10"]
        status, _ = cluster.wait_for_end("without1", timeout=60)
        assert status["state"] == "finished", status
    finally:
        stop_cluster(cluster)
