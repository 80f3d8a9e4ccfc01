"""The trainer's per-step breakdown and wire-byte count: bookkeeping (CUDA events faked), and real
2-rank gloo runs (torchrun on localhost)."""

import json

import breakdown
import checkpoint
import pytest
from test_training import train


class FakeEvent:
    """A CUDA event stand-in: records a time from a shared fake clock, counts synchronize calls."""

    now_ms = 0.0
    synchronized = 0

    def record(self):
        self.ms = FakeEvent.now_ms

    def elapsed_time(self, end):
        return end.ms - self.ms

    def synchronize(self):
        FakeEvent.synchronized += 1


def fake_step(timer, times_ms, hooks_at=()):
    """Marks one step at the given fake times (ms): start, data, forward, hooks..., backward, optimizer, end."""
    names = iter(["start", "data", "forward", "backward", "optimizer", "end"])
    for name, at in zip(names, times_ms):
        if name == "backward":
            for hook_at in hooks_at:
                FakeEvent.now_ms = hook_at
                breakdown.timed_hook(lambda state, bucket: None, timer)(None, None)
        FakeEvent.now_ms = at
        {"start": timer.begin, "end": timer.end}.get(name, lambda n=name: timer.mark(n))()


def test_cuda_events_give_the_parts_and_are_read_once_per_interval():
    timer = breakdown.StepTimer(breakdown.CudaClock(FakeEvent))
    FakeEvent.synchronized = 0
    fake_step(timer, [0, 10, 12, 100, 120, 121], hooks_at=[50, 80])
    fake_step(timer, [200, 202, 202, 300, 310, 330])  # no hook ran: no exposed communication
    assert FakeEvent.synchronized == 0, "a mark must not wait for the device"
    first, second = timer.resolve()
    assert FakeEvent.synchronized == 1 and timer.pending == []
    assert first == pytest.approx(
        {
            "data_s": 0.010,
            "compute_s": 0.068,
            "comm_exposed_s": 0.020,
            "optimizer_s": 0.020,
            "other_s": 0.003,
            "step_s": 0.121,
            "payload_bytes": 0,
            "buckets": 2,
        }
    )
    assert second["comm_exposed_s"] == 0 and second["compute_s"] == pytest.approx(0.098)
    assert sum(second[k] for k in breakdown.PARTS) == pytest.approx(second["step_s"])


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_two_rank_breakdown_sums_to_the_step_time_and_reaches_progress(numbers_data, tmp_path):
    train(numbers_data, tmp_path, "--max-steps", "8", "--batch-per-gpu", "8", "--log-every", "4", procs=2)
    s = summary(tmp_path)
    b = s["breakdown"]
    parts = sum(b[k] for k in breakdown.PARTS)
    print(f"breakdown sum {parts * 1000:.1f} ms vs measured step {s['avg_step_time_s'] * 1000:.1f} ms")
    assert abs(parts - s["avg_step_time_s"]) <= 0.1 * s["avg_step_time_s"]
    assert b["compute_s"] > 0 and b["comm_exposed_s"] > 0 and len(b["per_rank"]) == 2
    assert b["grad_bytes"] == b["payload_bytes"] and b["wire_bytes"] == b["payload_bytes"]  # ring of 2: 2(N-1)/N = 1
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert "ended" in progress and progress["world_size"] == 2


def payload(numbers_data, run_dir, compression) -> float:
    train(numbers_data, run_dir, "--max-steps", "7", "--batch-per-gpu", "4", "--grad-compression", compression, procs=2)
    return summary(run_dir)["breakdown"]["payload_bytes"]


def model_parameters(run_dir) -> list:
    from config import ModelConfig
    from model import Transformer

    state = checkpoint.load_latest(run_dir)
    vocab = state["model"]["embed.weight"].shape[0]
    return list(Transformer(ModelConfig(**state["config"]["model"]), vocab).parameters())


def test_fp16_sends_half_of_fp32_and_powersgd_what_its_factors_hold(numbers_data, tmp_path):
    full = payload(numbers_data, tmp_path / "none", "none")
    assert payload(numbers_data, tmp_path / "fp16", "fp16") == pytest.approx(full / 2, rel=0.01)
    rank = 4  # the default --powersgd-rank
    expected = 0
    for value in model_parameters(tmp_path / "none"):
        if value.dim() <= 1:
            expected += 4 * value.numel()
            continue
        n, m = value.shape[0], value.numel() // value.shape[0]
        r = min(rank, n, m)  # P is n x r, Q is m x r; PowerSGD sends a matrix raw unless that halves it
        expected += 4 * ((n + m) * r if (n + m) * r * 2 < n * m else n * m)
    psgd = payload(numbers_data, tmp_path / "psgd", "powersgd")  # steps 6-7: past start_powerSGD_iter 2
    print(f"payload per step: fp32 {full:.0f} B, PowerSGD rank {rank} {psgd:.0f} B (expected {expected})")
    assert psgd == expected
