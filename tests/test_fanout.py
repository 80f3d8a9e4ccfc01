"""Fan-out to the nodes against a real sshd (no cluster: one sshd plays every node, each node
addressed by an instance id through the Session Manager stand-in, which logs every connection)."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, run_fab
from one_sshd import needs_root_and_sshd, serve
from runfiles import full_status

from clusterops.inventory import Inventory, Node, SshSettings, write_known_hosts
from clusterops.nodes import remote
from clusterops.run import lifecycle

pytestmark = needs_root_and_sshd
PROXY = REPO / "tests" / "standins" / "ssm-session"
NODES = 3


@pytest.fixture
def nodes_via_proxy(tmp_path):
    """An inventory of NODES nodes named by instance id, all one real sshd behind the proxy stand-in;
    yields (inventory path, proxy log)."""
    with serve(tmp_path) as port:
        yield from _inventory(tmp_path, port)


def _inventory(tmp_path, port: int):
    ids = [f"i-0123456789abcdef{rank}" for rank in range(NODES)]
    (tmp_path / "hosts.json").write_text(json.dumps({i: "127.0.0.1" for i in ids}))
    write_known_hosts(tmp_path / "known_hosts", ids, (tmp_path / "host.pub").read_text(), port)
    log = tmp_path / "proxy.log"
    inventory = Inventory(
        cluster="fanout",
        source="aws",
        nodes=[Node(rank=r, name=f"node{r}", public_ip=ids[r], private_ip="127.0.0.1") for r in range(NODES)],
        gpus_per_node=1,
        ssh=SshSettings(
            user="root",
            port=port,
            key_file=str(tmp_path / "client"),
            known_hosts=str(tmp_path / "known_hosts"),
            proxy_command=f"{PROXY} --hosts {tmp_path / 'hosts.json'} --log {log} %h %p",
        ),
        data_dir=str(tmp_path / "data"),
        python=sys.executable,  # the node programs (cluster_node) from the checkout, as on the emulated cluster
        code_dir=str(REPO / "assets" / "train"),
    )
    inventory.save(tmp_path / "inventory.json")
    yield tmp_path / "inventory.json", log


def _sessions(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_status_opens_one_connection_per_node_and_shows_the_run(nodes_via_proxy):
    path, log = nodes_via_proxy
    inventory = Inventory.load(path)
    run = Path(inventory.data_dir) / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "run-status.json").write_text(json.dumps(full_status(state="finished", reason="done")))
    (run / "progress.json").write_text(json.dumps({"step": 7, "max_steps": 7, "avg_step_time_s": 0.25}))
    result = run_fab("status", GPU_CLUSTER_INVENTORY=str(path))
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("node") and line[4].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [(f"node{r}", "True") for r in range(NODES)], result.stdout
    assert f"run {run}: finished | step 7/7 | 250 ms/step | (done)" in result.stdout
    # The head's run line rides on the head's connection from the fan-out: no second set-up.
    assert sorted(_sessions(log)) == sorted(f"{n.public_ip} {inventory.ssh.port}" for n in inventory.nodes)


def test_connections_stay_open_from_one_fan_out_to_the_next(nodes_via_proxy):
    path, log = nodes_via_proxy
    result = run_fab("monitor", "--interval", "0.1", "--count", "3", GPU_CLUSTER_INVENTORY=str(path))
    assert result.returncode == 0 and result.stdout.count("node0") == 3, result.stdout + result.stderr
    assert len(_sessions(log)) == NODES


def test_run_overview_matches_the_step_by_step_probes(nodes_via_proxy):
    path, _ = nodes_via_proxy
    inventory = Inventory.load(path)
    with remote.connect(inventory, inventory.head) as conn:
        assert lifecycle.run_overview(conn, inventory) is None
        for name, state in (("old", "finished"), ("new", "running")):
            run = Path(inventory.data_dir) / "runs" / name
            run.mkdir(parents=True)
            (run / "run-status.json").write_text(json.dumps(full_status(state=state)))
            time.sleep(0.02)
        (run / "summary.json").write_text("{not json")
        latest = lifecycle.latest_run(conn, inventory)
        assert lifecycle.run_overview(conn, inventory) == (latest, lifecycle.run_state(conn, inventory, latest))


def test_sync_ships_the_node_package_beside_the_training_program(nodes_via_proxy):
    """/data/code becomes a package root like /workspace: train/ and cluster_node/ side by side."""
    path, _ = nodes_via_proxy
    result = run_fab("sync", GPU_CLUSTER_INVENTORY=str(path))
    assert result.returncode == 0, result.stderr
    code = Path(Inventory.load(path).data_dir) / "code"
    assert (code / "train" / "train.py").is_file() and (code / "cluster_node" / "programs" / "probe.py").is_file()
    assert (code / "cluster_node" / "daemons" / "autostop" / "watchdog.py").is_file()
    assert not list(code.rglob("__pycache__")), "no bytecode of the laptop's Python on the nodes"
    assert f"to {code}" in result.stdout


def test_fetch_during_a_run_brings_its_newest_checkpoint_or_says_there_is_none(nodes_via_proxy, tmp_path):
    """`fab fetch` during a run fetched no checkpoint and said nothing (issue 23 §9): a live run's newest
    checkpoint comes (best.pt is an earlier eval's); a run younger than its first checkpoint says so."""
    path, _ = nodes_via_proxy
    inventory = Inventory.load(path)
    run = Path(inventory.data_dir) / "runs" / "live"
    (run / "checkpoints").mkdir(parents=True)
    (run / "run-status.json").write_text(json.dumps(full_status(state="running")))
    (run / "config.json").write_text(json.dumps({"checkpoint_every": 100}))
    dest = tmp_path / "home"
    result = run_fab("fetch", "live", "--dest", str(dest), GPU_CLUSTER_INVENTORY=str(path))
    assert result.returncode == 0, result.stderr
    assert "no checkpoint yet: the run writes one every 100 steps" in result.stdout
    for name in ("best.pt", "step_00000100.pt", "step_00000200.pt"):
        (run / "checkpoints" / name).write_bytes(name.encode())
    result = run_fab("fetch", "live", "--dest", str(dest), GPU_CLUSTER_INVENTORY=str(path))
    assert "checkpoint: checkpoints/step_00000200.pt" in result.stdout, result.stdout + result.stderr
    (run / "run-status.json").write_text(json.dumps(full_status(state="finished")))
    result = run_fab("fetch", "live", "--dest", str(dest), GPU_CLUSTER_INVENTORY=str(path))
    assert "checkpoint: checkpoints/best.pt" in result.stdout, result.stdout + result.stderr


def test_a_long_wait_is_announced_before_it_starts(nodes_via_proxy):
    """`fab check` printed nothing for 19 s and `fab stop` for 12 s (issue 23 §12): each wait says what
    it waits for before it starts, on stderr, so `--json` output stays clean."""
    path, _ = nodes_via_proxy
    inventory = Inventory.load(path)
    result = run_fab("check", "--quick", "--json", GPU_CLUSTER_INVENTORY=str(path))
    assert result.stderr.startswith(f"check: probing {NODES} node(s)"), result.stderr
    assert json.loads(result.stdout)["nodes"], result.stdout
    run = Path(inventory.data_dir) / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "run-status.json").write_text(json.dumps(full_status(state="running")))
    ends = threading.Timer(1.5, lambda: (run / "run-status.json").write_text(json.dumps(full_status(state="finished"))))
    ends.start()
    result = run_fab("stop", "r1", GPU_CLUSTER_INVENTORY=str(path))
    ends.join()
    assert "stop: asked" in result.stderr and "waiting (up to 120 s)" in result.stderr, result.stderr
    assert (run / "STOP").exists() and "ended" in result.stdout, result.stdout
