"""The trainer's per-step breakdown and wire-byte count: bookkeeping (CUDA events faked), and real
2-rank gloo runs (torchrun on localhost)."""

import json
import re

import pytest
from test_training import train

from clusterops import terminal
from train import breakdown, checkpoint


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
    # 16 steps, not 8: on a machine shared with another test's ranks, 8 steps' averages drifted 13% apart
    result = train(numbers_data, tmp_path, "--max-steps", "16", "--batch-per-gpu", "8", "--log-every", "8", procs=2)
    assert re.search(
        # the parts are the slowest rank's, the step time rank 0's: said, so a first step's parts may
        # exceed it without looking wrong (issue 23 §13)
        r"step 8/16 \(50%\) \| loss .* \| slowest rank: data \d+ compute \d+ comm \d+ opt \d+ other -?\d+ ms \| "
        r"elapsed \d+s \| ETA \d+s",
        result.stdout,
    ), result.stdout
    s = summary(tmp_path)
    b = s["breakdown"]
    parts = sum(b[k] for k in breakdown.PARTS)
    print(f"breakdown sum {parts * 1000:.1f} ms, its rank's step {b['step_s'] * 1000:.1f} ms, rank 0's measured step "
          f"{s['avg_step_time_s'] * 1000:.1f} ms")  # fmt: skip
    # The parts account for their rank's whole step; that rank and rank 0 step together (the all-reduce),
    # measured over windows a loaded machine may skew apart (13% seen in a loaded `make test`): within 25%.
    assert parts == pytest.approx(b["step_s"], rel=1e-6)
    assert abs(b["step_s"] - s["avg_step_time_s"]) <= 0.25 * s["avg_step_time_s"]
    assert b["compute_s"] > 0 and b["comm_exposed_s"] > 0 and len(b["per_rank"]) == 2
    assert b["grad_bytes"] == b["payload_bytes"] and b["wire_bytes"] == b["payload_bytes"]  # ring of 2: 2(N-1)/N = 1
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert "ended" in progress and progress["world_size"] == 2


def test_durations_and_the_eta_in_fab_status():
    from cluster_node.tools import duration

    assert [duration(s) for s in (0.4, 45, 130, 3600 + 5 * 60 + 59)] == ["0s", "45s", "2m10s", "1h05m"]
    progress = {"step": 300, "max_steps": 600, "avg_step_time_s": 0.1, "eta_s": 130.2}
    from runfiles import run_files

    line = terminal.run_line("/runs/r", run_files(status={"state": "running"}, progress=progress))
    assert "step 300/600 | 100 ms/step | ETA 2m10s" in line
    later = run_files(status={"state": "running"}, progress={**progress, "eta_s": 3900.0})
    assert "| ETA 1h05m" in terminal.run_line("/runs/r", later)  # the trainer's own form, not 65m00s


def payload(numbers_data, run_dir, compression, *args) -> float:
    train(
        numbers_data,
        run_dir,
        "--max-steps",
        "7",
        "--batch-per-gpu",
        "4",
        "--grad-compression",
        compression,
        *args,
        procs=2,
    )
    return summary(run_dir)["breakdown"]["payload_bytes"]


def model_parameters(run_dir) -> list:
    from train.config import ModelConfig
    from train.model import Transformer

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
    # Steps 6-7 (past start_powerSGD_iter 2), in several DDP buckets on gloo (no longer forced to one).
    psgd = payload(numbers_data, tmp_path / "psgd", "powersgd", "--bucket-cap-mb", "0.1")
    print(f"payload per step: fp32 {full:.0f} B, PowerSGD rank {rank} {psgd:.0f} B (expected {expected})")
    assert psgd == expected
    b = summary(tmp_path / "psgd")["breakdown"]
    assert b["buckets"] > 1 and not b["single_bucket"]


def test_the_units_all_reduce_runs_while_the_first_forward_does(numbers_data, tmp_path, monkeypatch):
    """No blocking collective before the forward: the units/stop counts are summed asynchronously and
    waited for only once the first micro-batch's loss exists."""
    import torch
    import torch.distributed as dist

    from train.config import build_parser, config_from_args
    from train.distributed import DistInfo
    from train.train import compose

    args = ["--data", str(numbers_data), "--run-dir", str(tmp_path / "run"), "--recipe", "transformer-tiny"]
    config = config_from_args(build_parser("t").parse_args([*args, "--d-model", "32", "--ffn", "64"]))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        trainer = compose(config, DistInfo(), torch.device("cpu"))
        events = []
        original_all_reduce, original_loss = dist.all_reduce, trainer.task.loss_sum

        def all_reduce(tensor, *args, **kwargs):
            events.append(f"all_reduce async={kwargs.get('async_op', False)}")
            work = original_all_reduce(tensor, *args, **kwargs)
            return (
                work if work is None else type("Work", (), {"wait": lambda s: events.append("wait") or work.wait()})()
            )

        def loss_sum(module, batch):
            events.append("forward")
            return original_loss(module, batch)

        monkeypatch.setattr(dist, "all_reduce", all_reduce)
        monkeypatch.setattr(trainer.task, "loss_sum", loss_sum)
        trainer.train_step()
        assert events == ["all_reduce async=True", "forward", "wait"]
    finally:
        dist.destroy_process_group()


def test_the_verdicts_rank_is_the_one_the_others_wait_for_not_the_one_with_the_longest_step():
    """Ranks end a synchronised step together (their step times differ by noise); the one that
    computed longest waited least: its exposed time is the network's, the other's holds the wait."""
    straggler = dict(data_s=0.01, compute_s=0.60, comm_exposed_s=0.04, optimizer_s=0.02, other_s=0.0, step_s=0.670)
    waiting = dict(data_s=0.01, compute_s=0.48, comm_exposed_s=0.16, optimizer_s=0.02, other_s=0.0, step_s=0.671)
    assert breakdown.critical_rank([waiting, straggler]) == 1
    assert breakdown.critical_rank([straggler, waiting]) == 0


# One rank on gloo, the state and hook as the trainer registers them, in a process of its own that ends with
# os._exit: a DDP reducer freed after its test may drop the last reference to its gloo group on one of the
# group's own worker threads, whose destructor then joins that thread ("terminate called after throwing
# std::system_error: Resource deadlock avoided"): it aborted the suite's worker process between two tests.
POWERSGD_RUN = """
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from train import commhooks

class Net(torch.nn.Module):
    def __init__(self, zero):
        super().__init__()
        self.first, self.last = torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)
        self.scale = torch.nn.Parameter(torch.zeros(64) if zero else torch.ones(64))  # BN's zero-init gamma

    def forward(self, x):
        return self.last(self.first(x) * self.scale)

def run(rank, zero):
    torch.manual_seed(0)
    model = Net(zero)
    ddp = DDP(model)
    hook = commhooks.serialized_hook(commhooks.recovering_hook(powerSGD_hook.powerSGD_hook))
    state = commhooks.powersgd_state(rank)
    ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    finite, moved = [], []
    for step in range(8):
        loss = ddp(torch.randn(16, 64)).pow(2).sum() * (float("inf") if step == 4 else 1.0)
        loss.backward()
        finite.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        moved.append(bool(model.first.weight.grad.abs().sum() > 0))
        if finite[-1] and (step >= 2 or not zero):  # GradScaler skips overflowed steps (here the first two)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    errors = all(bool(torch.isfinite(e).all()) for e in state.error_dict.values())
    return dict(finite=finite, moved=moved, errors_finite=errors)

dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}/pg", rank=0, world_size=1)
print(json.dumps({f"{r}-{z}": run(r, z) for r, z in ((4, False), (1, True))}), flush=True)
os._exit(0)
"""


@pytest.fixture(scope="module")
def powersgd_runs(tmp_path_factory):
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = dict(os.environ, PYTHONPATH=f"{REPO / 'assets'}:{os.environ.get('PYTHONPATH', '')}")
    where = str(tmp_path_factory.mktemp("powersgd"))
    command = [sys.executable, "-c", POWERSGD_RUN, where]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("rank, zero", [(4, False), (1, True)])
def test_powersgd_recovers_from_an_overflowed_step_and_takes_an_all_zero_gradient(powersgd_runs, rank, zero):
    """fp16's loss scaling overflows on purpose now and then (GradScaler skips the step). PowerSGD's error
    feedback and warm-started Q carried that step's inf into every later one: gradients non-finite for good,
    every step skipped. And an all-zero gradient matrix (a ResNet block's last conv while its BN scale is
    still its initial 0) was 0/0 in Gram-Schmidt at rank <= 2: NaN every step (POWERSGD_RUN)."""
    run = powersgd_runs[f"{rank}-{zero}"]
    assert run["finite"] == [True] * 4 + [False] + [True] * 3  # the overflowed step alone
    assert run["errors_finite"]
    # A layer behind a zero scale has no gradient until the scale moves (after step 2, the first compressed
    # one: its zero matrix made Q zero); it must get one after (a zero Q gave P = MQ = 0 for good).
    moved = run["moved"]
    assert moved[3] and moved[5:] == [True] * 3, moved  # (the overflow at step 4 refreshes every Q anyway)
