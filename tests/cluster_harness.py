"""The emulated cluster as the cluster tests drive it: the real `fab` CLI against `fab local.up`'s
nodes, shared state watched through the host side of /data and the namespaces' process lists."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from conftest import REPO, tool_env

from clusterops.local import cluster as localcluster

QUICK = "--eval-every 100 --eval-samples 16 --checkpoint-every 10 --log-every 10 --dist-timeout-s 30"


class Cluster:
    def __init__(self, name: str, nodes: int, subnet: str, workdir: Path):
        self.name, self.nodes, self.subnet = name, nodes, subnet
        self.inventory = workdir / "inventory.json"
        self.env = tool_env(GPU_CLUSTER_INVENTORY=str(self.inventory))
        self.shared = localcluster.STATE_ROOT / name / "shared"

    def fab(
        self, *args: str, check: bool = True, timeout: float = 600, env: dict | None = None
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            ["fab", *args], cwd=REPO, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout
        )
        if check:
            assert result.returncode == 0, f"fab {' '.join(args)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return result

    def run_dir(self, run: str) -> Path:
        return self.shared / "runs" / run

    def progress(self, run: str) -> dict:
        path = self.run_dir(run) / "progress.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def run_status(self, run: str) -> dict:
        path = self.run_dir(run) / "run-status.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def wait_for_step(self, run: str, step: int, timeout: float = 180) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            current = self.progress(run).get("step", 0)
            if current >= step:
                return current
            assert self.run_status(run).get("state") in (None, "running"), self.run_status(run)
            time.sleep(0.1)
        raise AssertionError(f"{run} did not reach step {step} in {timeout} s")

    def wait_for_end(self, run: str, timeout: float) -> tuple[dict, float]:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            status = self.run_status(run)
            if status.get("state") not in (None, "running"):
                return status, time.monotonic() - started
            time.sleep(0.1)
        raise AssertionError(f"{run} still running after {timeout} s")

    def processes(self, rank: int, pattern: str) -> list[int]:
        netns = localcluster.LocalSpec(name=self.name, nodes=self.nodes).netns(rank)
        pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
        found = []
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if re.search(pattern, cmdline):
                found.append(int(pid))
        return found


def start_cluster(name: str, nodes: int, subnet: str, workdir: Path):
    cluster = Cluster(name, nodes, subnet, workdir)
    # --replace: a cluster left by an interrupted test run is replaced, not refused
    up = cluster.fab("local.up", "--nodes", str(nodes), "--name", name, "--subnet", subnet, "--replace")
    assert f"{nodes} node(s)" in up.stdout
    prepare_numbers(cluster, "--train 20000 --valid 200 --test 100")
    return cluster


# make test's phases share one (scripts/test_phases.sh sets it and removes it): the timed phase's first cluster
# would otherwise train the tokenizer again on its clock (~5 s).
DATA_CACHE_ENV = "GPU_CLUSTER_TEST_DATA_CACHE"
if os.environ.get(DATA_CACHE_ENV):
    DATA_CACHE = Path(os.environ[DATA_CACHE_ENV])
else:
    DATA_CACHE = Path(tempfile.gettempdir()) / f"gpu-cluster-test-data-{os.getpid()}"
    atexit.register(shutil.rmtree, DATA_CACHE, ignore_errors=True)


def prepare_numbers(cluster: Cluster, extra: str) -> None:
    """`fab data` with these prepare.py arguments. The BPE training is the slow part (7 s for 20000
    pairs): a data set made once in this session (in make test, once for both phases) is copied in first,
    and `fab data` then finds it complete (prepare.py's re-run with the same arguments is a no-op)."""
    cached = DATA_CACHE / re.sub(r"\W+", "_", extra)
    target = cluster.shared / "datasets" / "numbers"
    if cached.exists():
        shutil.copytree(cached, target, dirs_exist_ok=True)
    cluster.fab("data", "--extra", extra)
    if not cached.exists():  # whole or not at all: a later phase may copy it in
        partial = cached.with_name(cached.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(target, partial)
        partial.rename(cached)


def stop_cluster(cluster: Cluster):
    cluster.fab("local.down", "--name", cluster.name, "--yes", check=False)


def running(pid: int) -> bool:
    """Alive and not a zombie (where PID 1 does not reap orphans, killed nodes stay as zombies)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
