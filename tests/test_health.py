"""Node health verdicts on recorded probe facts, and the probe itself run on this machine."""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from test_launch import inventory

from clusterops.nodes import health


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
        # Every node alike would pass the majority check: torch without CUDA beside nvidia-smi's GPUs is bad alone.
        ({"nccl": None}, "bad", "torch finds no CUDA device though nvidia-smi lists 4: ranks would train on the CPU"),
        # `fab train --data`: a node back from a stop has no copy (the instance store is erased), or a cut-off one
        ({"copy": {"path": "/opt/dlami/nvme/imagenet", "state": "missing"}}, "bad", "no copy at /opt/dlami/nvme/"),
        ({"copy": {"path": "/opt/dlami/nvme/imagenet", "state": "unfinished"}}, "bad", "a staging cut off at /opt/"),
        ({"copy": {"path": "/opt/dlami/nvme/imagenet", "state": "staged"}}, "ok", ""),
    ],
)
def test_one_odd_node_among_three_gets_its_verdict_and_reason(overrides, verdict, words):
    result = verdicts({"node0": facts(), "node1": facts(**overrides), "node2": facts()}, controller_time=1000.0)
    assert result["node0"] == ("ok", "") and result["node2"] == ("ok", "")
    assert result["node1"][0] == verdict and words in result["node1"][1]


def test_torch_without_cuda_beside_nvidia_smis_gpus_is_bad_on_every_node():
    """The majority rule sees nothing when every node's torch lost CUDA (a driver older than the image's
    CUDA): each node is bad on its own facts."""
    result = verdicts({name: facts(nccl=None) for name in ("node0", "node1")})
    assert {verdict for verdict, _ in result.values()} == {"bad"}


def test_unreachable_is_bad_and_not_fit_to_train():
    found = health.assess({"node0": facts(), "node1": None}, expected_gpus=4, expected_gpu="A10G")
    assert [h.verdict for h in found] == ["ok", "bad"] and not health.fit_to_train(found)
    assert json.loads(health.as_json(found))["fit_to_train"] is False


def test_a_slow_pair_degrades_and_a_socket_transport_where_efa_was_expected_is_bad():
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
    assert result["node1"][0] == "bad" and "NCCL uses NET/Socket, not EFA" in result["node1"][1]


def test_a_cpu_node_says_gpu_checks_are_not_available():
    cpu = facts(gpus=[], cuda=None, nccl=None)
    found = health.assess({"node0": cpu}, expected_gpus=1, expected_gpu=None)
    assert found[0].verdict == "ok" and not found[0].reasons and "not available" in found[0].notes[0]


def _inventory(python: str, data: Path):
    """The checkout's package (REPO/assets, as on the emulated cluster), `python` and `data`."""
    return dataclasses.replace(inventory(), python=python, data_dir=str(data), code_dir=str(REPO / "assets" / "train"))


def test_the_probe_runs_and_reports_this_machine(tmp_path):
    command = health.probe_command(_inventory(sys.executable, tmp_path))
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    found = health.parse_probe(out.stdout)
    assert found["writable"] is True and found["mounted"] is False and found["free_gb"] > 0
    assert found["torch"].startswith("2.") and found["gpus"] == []


def test_the_probe_reports_the_state_of_a_runs_copy_on_its_own_disk(tmp_path):
    """A fresh review (session 30): a restart probed a node back from a Spot stop as healthy and ran a rank on it,
    though a stop had erased the run's --data copy; the probe now looks at the copy, and a missing one is bad."""
    copy = tmp_path / "nvme" / "imagenet"
    command = health.probe_command(_inventory(sys.executable, tmp_path), copy=str(copy))
    state = lambda: health.parse_probe(  # noqa: E731
        subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60).stdout
    )["copy"]["state"]
    assert state() == "missing"
    (copy / "train").mkdir(parents=True)
    (copy / ".staging").touch()
    assert state() == "unfinished"
    (copy / ".staging").unlink()
    assert state() == "present"
    (copy / ".staged.json").write_text("{}")
    assert state() == "staged"


# Stand-ins first on PATH: nvidia-smi (two A10Gs, the first with $ECC uncorrected errors) and dmesg (a
# kernel log with Xid $XID), in tests/probe_standins/.
PROBE_STANDINS = REPO / "tests" / "probe_standins"
FAKE_SMI = (PROBE_STANDINS / "nvidia-smi").read_text()


def _probe_with_fakes(tmp_path, ecc="0", xid="13", smi=FAKE_SMI) -> dict:
    """The real probe script, with a fake nvidia-smi and dmesg first on PATH (and the system python:
    no torch to import, so it runs in a blink)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("nvidia-smi", smi), ("dmesg", (PROBE_STANDINS / "dmesg").read_text())):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "ECC": ecc, "XID": xid}
    command = health.probe_command(
        _inventory(shutil.which("python3", path="/usr/bin:/bin") or sys.executable, tmp_path)
    )
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60, env=env)
    return {**health.parse_probe(out.stdout), "mounted": True}  # tmp_path is no mount point


@pytest.mark.parametrize(
    "ecc, xid, verdict, words",
    [
        ("0", "13", "ok", ""),
        ("2", "13", "bad", "2 uncorrectable ECC error(s)"),
        ("0", "95", "bad", "Xid 95 in the kernel log"),
        ("[N/A]", "13", "ok", ""),
    ],
)
def test_the_real_probe_with_a_fake_nvidia_smi_and_kernel_log_finds_ecc_and_xid(tmp_path, ecc, xid, verdict, words):
    found = _probe_with_fakes(tmp_path, ecc=ecc, xid=xid)
    assert len(found["gpus"]) == 2 and found["xid_source"] == "dmesg" and found["nvidia_smi"] == "ok"
    node = health.assess({"node0": found}, expected_gpus=2, expected_gpu="A10G")[0]
    assert node.verdict == verdict and words in "; ".join(node.reasons)


def test_a_failing_nvidia_smi_or_no_gpu_on_a_gpu_type_is_bad(tmp_path):
    broken = (
        '#!/bin/sh\necho "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."\nexit 9\n'
    )
    found = _probe_with_fakes(tmp_path, smi=broken)
    node = health.assess({"node0": found}, expected_gpus=4, expected_gpu="A10G")[0]
    assert node.verdict == "bad" and "nvidia-smi failed: NVIDIA-SMI has failed" in node.reasons[0]
    node = health.assess({"node0": facts(gpus=[])}, expected_gpus=4, expected_gpu="A10G")[0]
    assert node.verdict == "bad" and "no GPU visible" in node.reasons[0]


def test_expected_gpus_come_from_the_instance_type_table():
    assert health.expected_gpus("g5.12xlarge", 1) == (4, "A10G")
    assert health.expected_gpus("p4d.24xlarge", 1) == (8, "A100")
    assert health.expected_gpus("local", 2) == (2, None)


def test_clock_skew_is_measured_outside_the_probe_window():
    assert health.clock_skew(100.5, 100.0, 101.0) == 0.0
    assert health.clock_skew(103.0, 100.0, 101.0) == 2.0
    assert health.clock_skew(97.0, 100.0, 101.0) == -3.0
    node = health.assess({"node0": facts(skew_s=-3.0)}, expected_gpus=4, expected_gpu="A10G")[0]
    assert node.verdict == "degraded" and "clock off by -3.0 s" in node.reasons


def test_the_json_names_every_node_with_its_verdict_reasons_and_details():
    found = health.assess({"node0": facts(), "node1": facts(writable=False)}, expected_gpus=4, expected_gpu="A10G")
    doc = json.loads(health.as_json(found, fit_to_train=False, problems=[], link=None, training=None))
    assert doc["fit_to_train"] is False and [n["node"] for n in doc["nodes"]] == ["node0", "node1"]
    assert doc["nodes"][1]["verdict"] == "bad" and doc["nodes"][1]["reasons"] == ["/data is not writable"]
    assert doc["nodes"][0]["details"]["gpus"] == 4 and doc["nodes"][0]["details"]["gpu"] == "NVIDIA A10G"


def test_a_transport_verdict_where_efa_was_expected_refuses_training_in_one_line():
    """fab check's verdict, kept on /data for fab train: sockets where EFA was expected refuse training
    (aws-ofi-nccl that does not load leaves NCCL on its Socket transport without an error)."""
    verdict = health.transport_verdict({"node0": "efa", "node1": "socket"}, expect_efa=True, checked_at="T")
    assert verdict["not_efa"] == ["node1"]
    refusal = health.transport_refusal(verdict, ["node0", "node1"], expect_efa=True)
    assert refusal and "\n" not in refusal and "node1" in refusal and "--allow-tcp" in refusal
    assert "socket" in refusal and "fab check" in refusal
    assert health.transport_refusal(verdict, ["node0"], expect_efa=True) is None  # node1 left out
    assert health.transport_refusal(verdict, ["node0", "node1"], expect_efa=False) is None
    assert health.transport_refusal(None, ["node0", "node1"], expect_efa=True) is None  # never checked
    fine = health.transport_verdict({"node0": "efa", "node1": "efa"}, expect_efa=True, checked_at="T")
    assert health.transport_refusal(fine, ["node0", "node1"], expect_efa=True) is None
