"""`fab local.down` and `fab local.up --repair` on the emulated cluster (issue 23 §4, §13).

Contracts: a run is "fetched" when every file `fab fetch` brings home (clusterops/nodes/remote.py
`_download_run`: config, summary, log, status, report, the chosen checkpoint, the last evals) is
unchanged since the `.fetched` marker that fetch leaves; files fetch never takes (progress.json, rank
logs, older checkpoints) do not make a run unfetched. `local.down` refuses, as `local.up` refuses
without --replace, while such runs would be deleted; `--yes` deletes them.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from cluster_harness import Cluster, running
from runfiles import full_status

from clusterops.local import cluster as localcluster

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster needs root")]
NAME, SUBNET = "tf", "10.213.150.0/24"


def _write_run(cluster: Cluster, run: str) -> None:
    run_dir = cluster.run_dir(run)
    (run_dir / "checkpoints").mkdir(parents=True)
    # the files as the trainer and the supervisor write them: fab fetch reads them as records
    (run_dir / "config.json").write_text(json.dumps({"recipe": "transformer-tiny", "max_steps": 10}))
    (run_dir / "summary.json").write_text(json.dumps({"recipe": "transformer-tiny", "steps": 10}))
    (run_dir / "run-status.json").write_text(json.dumps(full_status(state="finished", exit_code=0)))
    (run_dir / "checkpoints" / "step_00000010.pt").write_bytes(b"weights")


def _ssh(cluster: Cluster, rank: int, command: str) -> subprocess.CompletedProcess:
    ssh = json.loads(cluster.inventory.read_text())["ssh"]
    return subprocess.run(
        ["ssh", "-i", ssh["key_file"], "-p", str(ssh["port"]), "-o", f"UserKnownHostsFile={ssh['known_hosts']}"]
        + ["-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=3", "-o", "BatchMode=yes"]
        + [f"root@{localcluster.LocalSpec(name=NAME, subnet=SUBNET).node_ip(rank)}", command],
        capture_output=True,
        text=True,
        timeout=30,
    )


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [n for n in listed if n.startswith(f"gc-{NAME}-")]


def test_down_refuses_to_delete_unfetched_runs_and_repair_brings_a_dead_node_back(tmp_path):
    cluster = Cluster(NAME, 2, SUBNET, tmp_path)
    cluster.fab("local.up", "--nodes", "2", "--name", NAME, "--subnet", SUBNET, "--replace")
    try:
        for run in ("kept", "changed", "fresh"):
            _write_run(cluster, run)
        for run in ("kept", "changed"):
            cluster.fab("fetch", "--run", run, "--dest", str(tmp_path / "runs"))
        time.sleep(0.05)  # a later mtime than the marker's
        (cluster.run_dir("kept") / "progress.json").write_text("{}")  # fetch never takes it
        (cluster.run_dir("changed") / "summary.json").write_text('{"state": "finished", "bleu": 1}\n')

        refused = cluster.fab("local.down", "--name", NAME, check=False)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        line = refused.stderr.strip()
        assert "\n" not in line and "changed, fresh" in line and "kept" not in line and "--yes" in line, line
        assert len(_namespaces()) == 2 and cluster.run_dir("fresh").exists()  # nothing was deleted

        # a dead node: every process in its namespace gone, as when its entrypoint crashes
        for pid in cluster.processes(1, r"."):
            os.kill(pid, 9)
        time.sleep(0.5)
        assert _ssh(cluster, 1, "true").returncode != 0
        repaired = cluster.fab("local.up", "--nodes", "2", "--name", NAME, "--subnet", SUBNET, "--repair").stdout
        assert "node1" in repaired and "node0" not in repaired, repaired
        assert _ssh(cluster, 1, "ls /data/runs").stdout.split() == ["changed", "fresh", "kept"]

        down = cluster.fab("local.down", "--name", NAME, "--yes").stdout
        assert "deleted with /data, never fetched or changed since: runs changed, fresh" in down, down
        assert "2 node namespace(s) and the bridge removed" in down, down
        assert not _namespaces() and not (localcluster.STATE_ROOT / NAME).exists()
    finally:
        cluster.fab("local.down", "--name", NAME, "--yes", check=False)
        assert not [p for r in range(2) for p in cluster.processes(r, r".") if running(p)]
