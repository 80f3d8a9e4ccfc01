"""The trainer's step breakdown on the emulated cluster: 2 nodes, links capped at 100 Mbit."""

from __future__ import annotations

import json
import os

import pytest
from cluster_harness import Cluster, prepare_numbers

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timed,
    pytest.mark.skipif(os.geteuid() != 0, reason="the emulated cluster needs root"),
]
PARTS = ("data_s", "compute_s", "comm_exposed_s", "optimizer_s", "other_s")


@pytest.fixture(scope="module")
def capped_pair(tmp_path_factory):
    cluster = Cluster("tbreak", 2, "10.213.70.0/24", tmp_path_factory.mktemp("tbreak"))
    cluster.fab(
        "local.up", "--nodes", "2", "--name", "tbreak", "--subnet", cluster.subnet, "--link", "100mbit", "--replace"
    )
    try:
        prepare_numbers(cluster, "--train 20000 --valid 200 --test 100")
        yield cluster
    finally:
        cluster.fab("local.down", "--name", "tbreak", "--yes", check=False)


def test_the_breakdown_sums_to_the_step_time_and_shows_exposed_communication(capped_pair):
    extra = "--eval-every 1000 --eval-samples 4 --checkpoint-every 1000 --log-every 4 --d-model 64 --ffn 128"
    capped_pair.fab("train", "--run", "parts", "--steps", "25", "--batch-per-gpu", "8", "--follow", "--extra", extra)
    summary = json.loads((capped_pair.run_dir("parts") / "summary.json").read_text())
    b, step = summary["breakdown"], summary["avg_step_time_s"]
    parts = sum(b[k] for k in PARTS)
    print(f"parts {parts * 1000:.1f} ms, measured {step * 1000:.1f} ms, exposed {b['comm_exposed_s'] * 1000:.1f} ms")
    assert abs(parts - step) <= 0.1 * step
    assert b["comm_exposed_s"] > 0 and b["payload_bytes"] > 0 and len(b["per_rank"]) == 2
