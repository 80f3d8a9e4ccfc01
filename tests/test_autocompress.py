"""--grad-compression auto: the choice follows the same model as `fab report`, from measured inputs."""

import json

import pytest
import torch

from clusterops.predict import bottleneck
from train import autocompress, stepmodel

MB = 1e6
CALIBRATION = {
    "grad_bytes": 100 * MB,
    "overhead_s": {"fp16": 0.02, "bf16": 0.02, "powersgd": 0.06},
    "powersgd_wire_bytes": stepmodel.ring_wire_bytes(2 * MB, 2),
}


def test_the_controller_and_the_node_run_the_same_model():
    assert bottleneck.what_ifs.__code__.co_filename == stepmodel.what_ifs.__code__.co_filename


SLOW_POWERSGD = {**CALIBRATION, "overhead_s": {**CALIBRATION["overhead_s"], "powersgd": 0.2}}


@pytest.mark.parametrize(
    "link_gbit, calibration, expected",
    [
        (0.1, CALIBRATION, "powersgd"),  # 8 s on the wire: none 8.5, fp16 4.52, PowerSGD 0.72
        (100.0, CALIBRATION, "none"),  # 8 ms: none 0.508, fp16 0.524, PowerSGD 0.56
        (8 / 3, SLOW_POWERSGD, "fp16"),  # 0.3 s: none 0.8, fp16 0.67, PowerSGD 0.706
    ],
)
def test_auto_picks_the_mode_the_model_predicts_fastest(link_gbit, calibration, expected):
    b = autocompress.auto_breakdown(0.5, link_gbit, calibration, 2, 64)
    mode, why, predicted = autocompress.choose(b, link_gbit)
    assert set(predicted) == {"none", "fp16", "bf16", "powersgd"}
    assert mode == expected and min(predicted.values()) == pytest.approx(predicted[mode]), why
    assert f"{link_gbit:.2f} Gbit/s" in why


def test_auto_keeps_plain_gradients_unless_a_mode_wins_by_the_margin():
    # 80 ms on the wire at 10 Gbit/s: none 0.58, fp16 0.56 (3% faster), PowerSGD 0.5616.
    b = autocompress.auto_breakdown(0.5, 10.0, CALIBRATION, 2, 64)
    mode, why, predicted = autocompress.choose(b, 10.0)
    assert predicted["fp16"] < predicted["none"] and mode == "none" and "must win by 5%" in why


def test_calibrate_times_each_mode_and_counts_powersgd_bytes_like_the_hook():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    calibration = autocompress.calibrate(list(model.parameters()), powersgd_rank=4, world_size=2)
    shapes = [(256, 64), (256,), (10, 256), (10,)]
    assert calibration["powersgd_wire_bytes"] == stepmodel.powersgd_wire_bytes(shapes, 4, 2)
    assert calibration["grad_bytes"] == 4 * sum(p.numel() for p in model.parameters())
    assert set(calibration["overhead_s"]) == {"fp16", "bf16", "powersgd"}
    assert all(0 < seconds < 1 for seconds in calibration["overhead_s"].values())


def test_calibrate_waits_for_the_device_around_each_timed_run(monkeypatch):
    """On a GPU each mode's work is queued: timed without a wait, the overheads were the launches alone
    (near zero), and `auto` favoured compression. Every timed run is waited for before and after."""
    waits = []
    monkeypatch.setattr(autocompress, "_sync", lambda device: lambda: waits.append(device.type))
    autocompress.calibrate(torch.nn.Linear(32, 32).parameters(), 2, 2, torch.device("cpu"))
    assert len(waits) == 3 * 3 * 2  # three modes, three repeats each, a wait before and after


def test_two_ranks_with_auto_log_the_choice_and_why_and_record_it(numbers_data, tmp_path):
    """Under torchrun (strict device mode: the probe's all-reduce names its device), rank 0's choice
    is every rank's, logged with the measurement, and summary.json keeps it and the calibration."""
    from test_training import train

    result = train(numbers_data, tmp_path, "--max-steps", "3", "--grad-compression", "auto", procs=2)
    line = next(line for line in result.stdout.splitlines() if line.startswith("--grad-compression auto: "))
    summary = json.loads((tmp_path / "summary.json").read_text())
    chosen = summary["auto_compression"]["chosen"]
    assert chosen in ("none", "fp16", "bf16", "powersgd") and summary["grad_compression"] == chosen
    assert line.startswith(f"--grad-compression auto: {chosen}: compute ") and "Gbit/s); predicted none" in line
    assert set(summary["calibration"]["overhead_s"]) == {"fp16", "bf16", "powersgd"}
