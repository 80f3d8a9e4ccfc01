"""Node health verdicts on recorded probe facts, and the probe itself run on this machine."""

import json
import subprocess
import sys

import pytest

from clusterops import health


def facts(**overrides) -> dict:
    base = {
        "time": 1000.0,
        "mounted": True,
        "writable": True,
        "free_gb": 500.0,
        "xids": [],
        "gpus": [{"name": "NVIDIA A10G", "driver": "550.127.05", "ecc_uncorrected": 0}] * 4,
        "torch": "2.6.0a0",
        "cuda": "12.6",
        "nccl": "2.23.4",
    }
    return {**base, **overrides}


def verdicts(nodes: dict, **kwargs) -> dict:
    found = health.assess(nodes, expected_gpus=4, expected_gpu="A10G", **kwargs)
    return {h.node: (h.verdict, "; ".join(h.reasons)) for h in found}


@pytest.mark.parametrize(
    "overrides, verdict, words",
    [
        ({}, "ok", ""),
        (
            {"gpus": [{"name": "NVIDIA A10G", "driver": "550.127.05", "ecc_uncorrected": 0}] * 3},
            "bad",
            "3 GPU(s), expected 4",
        ),
        (
            {"gpus": [{"name": "NVIDIA A10G", "driver": "550.127.05", "ecc_uncorrected": 2}] * 4},
            "bad",
            "uncorrectable ECC",
        ),
        ({"xids": [13, 79]}, "bad", "Xid 79"),
        ({"xids": [13]}, "ok", ""),  # Xid 13 is an application error, not the GPU's
        ({"mounted": False}, "bad", "/data is not mounted"),
        ({"writable": False}, "bad", "/data is not writable"),
        ({"free_gb": 5.0}, "degraded", "5.0 GB free"),
        ({"torch": "2.5.1"}, "degraded", "torch 2.5.1 differs from the other nodes' 2.6.0a0"),
        ({"gpus": [{"name": "NVIDIA A10G", "driver": "535.1", "ecc_uncorrected": 0}] * 4}, "degraded", "driver 535.1"),
        ({"time": 1005.0}, "degraded", "clock off by +5.0 s"),
    ],
)
def test_one_odd_node_among_three_gets_its_verdict_and_reason(overrides, verdict, words):
    result = verdicts({"node0": facts(), "node1": facts(**overrides), "node2": facts()}, controller_time=1000.0)
    assert result["node0"] == ("ok", "") and result["node2"] == ("ok", "")
    assert result["node1"][0] == verdict and words in result["node1"][1]


def test_unreachable_is_bad_and_not_fit_to_train():
    found = health.assess({"node0": facts(), "node1": None}, expected_gpus=4, expected_gpu="A10G")
    assert [h.verdict for h in found] == ["ok", "bad"] and not health.fit_to_train(found)
    assert json.loads(health.as_json(found))["fit_to_train"] is False


def test_a_slow_pair_and_a_socket_transport_where_efa_was_expected_degrade():
    links = {
        ("node0", "node1"): 95.0,
        ("node1", "node2"): 96.0,
        ("node0", "node2"): 40.0,
        ("node1", "node0"): 94.0,
        ("node2", "node1"): 97.0,
        ("node2", "node0"): 41.0,
    }
    result = verdicts(
        {n: facts() for n in ("node0", "node1", "node2")},
        links=links,
        transport={"node0": "NET/OFI efa", "node1": "NET/Socket", "node2": "NET/OFI efa"},
        expect_efa=True,
    )
    assert result["node0"][0] == "degraded" and "slow link node0->node2: 40.00" in result["node0"][1]
    assert result["node1"][0] == "degraded" and "NCCL uses NET/Socket, not EFA" in result["node1"][1]


def test_a_cpu_node_says_gpu_checks_are_not_available():
    cpu = facts(gpus=[], cuda=None, nccl=None)
    found = health.assess({"node0": cpu}, expected_gpus=1, expected_gpu=None)
    assert found[0].verdict == "ok" and "not available" in found[0].reasons[0]


def test_the_probe_runs_and_reports_this_machine(tmp_path):
    out = subprocess.run(
        ["bash", "-c", health.probe_script(sys.executable, str(tmp_path))], capture_output=True, text=True, timeout=60
    )
    found = health.parse_probe(out.stdout)
    assert found["writable"] is True and found["mounted"] is False and found["free_gb"] > 0
    assert found["torch"].startswith("2.") and found["gpus"] == []
