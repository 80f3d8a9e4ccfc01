"""Background checkpoints and in-memory snapshots (issue 30): the loop's stall, a writer killed mid-write,
the resume's choice between a checkpoint and the nodes' snapshots, and a resume from a snapshot."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import prewarmed
import pytest
import torch
from conftest import REPO, tool_env
from test_training import SMALL, TORCHRUN, losses, train

from cluster_node.programs import snapshots
from cluster_node.protocol import rundir
from train import checkpoint, snapshot


def _script(name: str):
    """A script of scripts/ as a module, loaded from its path (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_checkpoint = _script("bench_checkpoint")


def test_the_loops_stall_per_checkpoint_is_at_most_a_quarter_of_a_synchronous_save(tmp_path):
    """transformer-base (model + Adam, 727 MB) on CPU, both ways in one process: the synchronous save the
    trainer did before, and the copy the loop now waits for (the write runs on the writer thread). Alone
    the ratio is 0.026-0.033; beside the rest of the suite on two cores a CI run measured 0.13 (the copy
    0.26 s, memory-bound, where the save's 2.0 s hardly moved): the bound still tells a copy from a save."""
    figures = bench_checkpoint.measure(tmp_path, repeats=2)
    print(bench_checkpoint.line(figures))
    assert figures["mb"] > 700
    assert figures["stall_s"] <= 0.25 * figures["sync_s"], figures
    assert [p.name for p in checkpoint.list_steps(tmp_path)][-1] == "step_00000004.pt"  # written, flushed


CHILD = """
import sys, time, torch
from pathlib import Path
from train import checkpoint, snapshot
run, kind = Path(sys.argv[1]), sys.argv[2]
writer = snapshot.StateWriter(torch.device("cpu"))
def write(step):
    if kind == "snapshot":
        return checkpoint.persist_snapshot(run / "shm", run, step)
    return checkpoint.persist(run, step, keep=3, best=False, log=lambda line: None)
writer.submit({"step": 1, "model": {"w": torch.ones(4)}}, [write(1)])
writer.flush()
big = {"step": 2, "model": {f"w{i}": torch.full((25_000_000,), 2.0) for i in range(16)}}  # 1.6 GB
writer.submit(big, [write(2)])
print("writing", flush=True)
time.sleep(600)
"""


def _kill_mid_write(run: Path, kind: str) -> Path:
    """A writer process (the real StateWriter) killed while its temp file grows; returns that file."""
    target = run / "shm" / rundir.SNAPSHOT.format(step=2) if kind == "snapshot" else rundir.checkpoint(run, 2)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(run), kind],
        stdout=subprocess.PIPE,
        text=True,
        env=tool_env(),
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            partial = [p for p in target.parent.glob(f".{target.name}.tmp.*") if p.stat().st_size > 0]
            if partial:
                child.send_signal(signal.SIGKILL)
                child.wait(10)
                return partial[0]
            time.sleep(0.001)
        raise AssertionError("the writer never started its temp file")
    finally:
        child.kill()
        child.wait(10)


def test_a_checkpoint_writer_killed_mid_write_leaves_the_previous_checkpoint_the_resume_point(tmp_path):
    partial = _kill_mid_write(tmp_path, "checkpoint")
    assert partial.exists() and not rundir.checkpoint(tmp_path, 2).exists()
    assert [p.name for p in checkpoint.list_steps(tmp_path)] == ["step_00000001.pt"]
    assert checkpoint.load_agreed(tmp_path, True, lambda choice: choice)["step"] == 1
    checkpoint.save(tmp_path, 3, {"step": 3, "model": {}}, keep=3)  # the next write clears the dead one's file
    assert not partial.exists()


def test_a_checkpoint_another_rank_cannot_read_is_an_io_fault_a_restart_retries_not_a_missing_data_set(tmp_path):
    """train.py exits 2 on FileNotFoundError (no data set), and the supervisor does not relaunch a trainer that
    exits 2 before its first step: rank 0's choice unreadable here (EIO, ESTALE on EFS) must not read as one."""
    chosen = {"path": str(tmp_path / "checkpoints" / "step_00000007.pt")}
    with pytest.raises(checkpoint.CheckpointUnreadable, match="chosen by rank 0, is not readable here") as raised:
        checkpoint.load_agreed(tmp_path, False, lambda choice: chosen)
    assert not isinstance(raised.value, FileNotFoundError)


def test_a_snapshot_writer_killed_mid_write_leaves_the_previous_snapshot(tmp_path):
    partial = _kill_mid_write(tmp_path, "snapshot")
    held = tmp_path / "shm"
    assert partial.exists() and checkpoint.load_snapshot(held, tmp_path)["step"] == 1
    assert snapshots.held(tmp_path) == {"shm": {"step": 1, "bytes": (held / "snapshot_00000001.pt").stat().st_size}}
    (tmp_path / rundir.CONFIG).write_text("{}")
    state = checkpoint.load_agreed(tmp_path, True, lambda c: c, snapshot=held, gather=lambda step: [step])
    assert state["step"] == 1 and state["path"] == str(held / "snapshot_00000001.pt")
    checkpoint.persist_snapshot(held, tmp_path, 3)({"step": 3, "model": {}}, 0.0)  # RAM: the dead one's file goes
    assert not partial.exists() and checkpoint.load_snapshot(held, tmp_path)["step"] == 3
    assert [p.name for p in held.iterdir()] == ["snapshot_00000003.pt"]  # one snapshot held, the older gone


def test_a_snapshot_that_cannot_be_written_is_one_line_and_the_run_goes_on(tmp_path):
    """/dev/shm full (DataLoader workers share it) or gone: the write's error stays on the writer's side."""
    (tmp_path / "shm").write_text("not a directory")
    said: list[str] = []
    checkpoint.persist_snapshot(tmp_path / "shm" / "run", tmp_path, 3, said.append)({"step": 3, "model": {}}, 0.0)
    assert len(said) == 1 and said[0].startswith("warning: snapshot at step 3 not written (")
    assert said[0].endswith("; the older one stays")


def _snapshot(run: Path, step: int) -> Path:
    held = run / "shm"
    checkpoint.persist_snapshot(held, run, step)({"step": step, "model": {}}, 0.0)
    return held


@pytest.mark.parametrize(
    "snapshot_steps, config, resumed",
    [
        ([6, 6], True, 6),  # every rank holds step 6: newer than the checkpoint at 4
        ([3, 3], True, 4),  # older than the checkpoint
        ([4, 4], True, 4),  # as new: the snapshot (RAM, not a read from /data)
        ([6, None], True, 4),  # one node has none (a replaced node)
        ([6, 5], True, 4),  # a node whose last snapshot write was killed
        ([6, 6], False, 4),  # no config.json: a new run under the name of an old one
    ],
    ids=["newer", "older", "tie", "one-node-without", "steps-differ", "new-run"],
)
def test_the_resume_takes_a_snapshot_only_when_every_rank_holds_one_newer_than_the_checkpoint(
    tmp_path, snapshot_steps, config, resumed
):
    for step in (2, 4):
        checkpoint.save(tmp_path, step, {"step": step, "model": {}}, keep=3)
    if config:
        (tmp_path / rundir.CONFIG).write_text("{}")
    held = _snapshot(tmp_path, snapshot_steps[0])
    state = checkpoint.load_agreed(tmp_path, True, lambda c: c, snapshot=held, gather=lambda mine: snapshot_steps)
    assert state["step"] == resumed
    from_memory = resumed == snapshot_steps[0] and len(set(snapshot_steps)) == 1 and config
    assert (Path(state["path"]).parent == held) is bool(from_memory)


def test_a_snapshot_of_another_run_directory_is_ignored(tmp_path):
    held = _snapshot(tmp_path / "old", 9)
    assert checkpoint.load_snapshot(held, tmp_path / "new", log=lambda line: None) is None


def test_the_snapshot_is_per_node_and_the_local_cluster_can_move_it():
    assert snapshot.snapshot_dir("/data/runs/base", {}) == Path("/dev/shm/gpu-cluster/base")
    moved = snapshot.snapshot_dir("/data/runs/base", {rundir.SNAPSHOT_DIR_ENV: "/run/gpu-cluster/snapshots"})
    assert moved == Path("/run/gpu-cluster/snapshots/base")


def test_a_snapshot_that_does_not_fit_the_nodes_memory_is_refused_in_one_line(tmp_path):
    assert snapshot.memory_refusal(1_000_000, tmp_path) is None
    refusal = snapshot.memory_refusal(1 << 50, tmp_path)
    assert refusal and "\n" not in refusal and refusal.startswith("snapshots off on this node")


@pytest.mark.parametrize("held_by", ["this-node", "copied-to-data"])
def test_a_run_killed_between_checkpoints_resumes_from_its_snapshot_with_the_same_losses(
    numbers_data, tmp_path, held_by
):
    """A snapshot every step, no checkpoint before the kill (SIGKILL, as a lost node): the resume starts
    at the snapshot's step, and its losses are the uninterrupted run's. copied-to-data: the restart's node
    holds none (a replaced node): the survivor's snapshot, copied to /data by the supervisor's
    `cluster_node.programs.snapshots persist`, is the checkpoint it resumes from."""
    shm = tmp_path / "shm"
    flags = ["--batch-per-gpu", "8", "--dropout", "0.1", "--batching", "tokens", "--eval-every", "1000"]
    whole = train(numbers_data, tmp_path / "whole", "--max-steps", "10", *flags)
    command = [sys.executable, "-m", "train.train", "--data", str(numbers_data), "--run-dir", str(tmp_path / "split")]
    env = tool_env(OMP_NUM_THREADS="1", **{rundir.SNAPSHOT_DIR_ENV: str(shm)})
    child = subprocess.Popen(
        [*command, *SMALL, "--max-steps", "40", "--snapshot-seconds", "0.001", *flags],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("step 6/"):  # a snapshot may be in flight: the older one is the resume point
            os.kill(child.pid, signal.SIGKILL)
            break
    child.wait(30)
    assert checkpoint.list_steps(tmp_path / "split") == []
    [(name, held)] = snapshots.held(shm).items()  # the step its newest complete snapshot holds (the probe's)
    assert name == "split" and held["step"] >= 2
    if held_by == "copied-to-data":
        copied = snapshots.persist(tmp_path / "split", held["step"], {rundir.SNAPSHOT_DIR_ENV: str(shm)})
        assert copied["copied"] and Path(copied["path"]).parent.name == rundir.CHECKPOINTS
        shutil.rmtree(shm)  # the node that resumes holds nothing
    second = prewarmed.run(
        [*command, *SMALL, "--max-steps", "10", "--snapshot-seconds", "0.001", *flags],
        timeout=300,
        env=env,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = losses(second.stdout)
    start = min(resumed) - 1
    where = f"this node's snapshot {shm}" if held_by == "this-node" else str(tmp_path / "split" / rundir.CHECKPOINTS)
    assert start == held["step"] and f"resuming from {where}" in second.stdout, second.stdout[-2000:]
    assert resumed == {step: loss for step, loss in losses(whole.stdout).items() if step > start}
    assert not list(shm.rglob("*.pt")), "a run that ended at its checkpoint leaves no snapshot in memory"


def _worker(*args: str, procs: int = 1) -> subprocess.CompletedProcess:
    launcher = [*TORCHRUN, str(procs)] if procs > 1 else [sys.executable]
    result = prewarmed.run(
        [*launcher, str(REPO / "tests" / "async_worker.py"), *args],
        timeout=300,
        env=tool_env(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def test_a_stop_ends_the_trainer_only_after_its_checkpoint_is_on_disk(numbers_data, tmp_path):
    """Every checkpoint write 3 s slow: the STOP's records come after it and the process (which ends with
    os._exit, the writer thread with it) leaves it on disk."""
    (tmp_path / rundir.STOP).write_text("now: spot notice")
    run = ["--data", str(numbers_data), "--run-dir", str(tmp_path), *SMALL, "--max-steps", "50"]
    result = _worker("slow-writer", *run, "--batch-per-gpu", "4")
    assert [p.name for p in checkpoint.list_steps(tmp_path)] == ["step_00000001.pt"]
    assert result.stdout.index(f"checkpoint {tmp_path}") < result.stdout.index("run ended at step 1: stop requested")
    progress = rundir.read_record(tmp_path / rundir.PROGRESS, rundir.Progress)
    assert progress and progress.ended_by == "stop"


@pytest.mark.parametrize(
    "rank1_holds, checkpoints, resumed",
    [(True, True, 4), (False, True, 2), (False, False, 0)],
    ids=["both-nodes", "rank1-node-without", "rank1-node-without-no-checkpoint"],
)
def test_two_ranks_resume_from_their_nodes_snapshots_only_when_both_hold_the_step(
    numbers_data, tmp_path, rank1_holds, checkpoints, resumed
):
    """Two ranks as two nodes (each its own snapshot directory), through the real gather and broadcast:
    rank 1's node without the snapshot sends both ranks to the checkpoint, or without one to the start;
    then node0 keeps its snapshot (the run's own: the supervisor may still copy it for a later attempt)."""
    run = tmp_path / "run"
    flags = ["--data", str(numbers_data), "--run-dir", str(run), *SMALL[2:], "--batch-per-gpu", "4"]
    train(numbers_data, run, "--max-steps", "2", "--batch-per-gpu", "4", procs=2)  # resumed at its global batch
    state = checkpoint.load_latest(run)
    if not checkpoints:
        shutil.rmtree(run / rundir.CHECKPOINTS)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes[: 2 if rank1_holds else 1]:
        held = snapshot.snapshot_dir(run, {rundir.SNAPSHOT_DIR_ENV: str(node)})
        checkpoint.persist_snapshot(held, run, 4)({**state, "step": 4}, 0.0)
    result = _worker("resume", *map(str, nodes), "--recipe", "transformer-tiny", *flags, procs=2)
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1] and all(r["step"] == resumed for r in ranks), ranks
    if rank1_holds:
        assert all(r["path"].startswith(str(nodes[r["rank"]])) for r in ranks), ranks
    assert list((nodes[0] / "run").glob(rundir.SNAPSHOT_GLOB)), "this run's snapshot was dropped"


def test_the_written_copy_is_the_state_at_the_copy_and_tied_tensors_stay_tied(tmp_path):
    """The loop changes the state in place right after submit: the file holds the values at the copy."""
    weight = torch.ones(1000)
    state = {"step": 1, "model": {"embed": weight, "out": weight.view(1000)}, "config": {"lr": [1.0]}}
    writer = snapshot.StateWriter(torch.device("cpu"))
    writer.submit(state, [checkpoint.persist(tmp_path, 1, keep=1, best=False, log=lambda line: None)])
    weight.add_(1)
    state["config"]["lr"][0] = 2.0
    writer.close()
    saved = checkpoint.load_latest(tmp_path)
    assert torch.equal(saved["model"]["embed"], torch.ones(1000)) and saved["config"]["lr"] == [1.0]
    assert saved["model"]["embed"].data_ptr() == saved["model"]["out"].data_ptr()


SPECS = [
    ((3, 5), torch.float32),
    ((7,), torch.bfloat16),
    ((), torch.int64),
    ((0,), torch.bool),
    ((2, 3, 4), torch.float16),
    ((9,), torch.uint8),
    ((1,), torch.float64),
]


def test_the_writers_host_buffers_are_aligned_views_of_one_block_per_dtype(tmp_path):
    """One allocation per dtype for the whole state (on a GPU one page-locking call each, not one per
    tensor): each buffer a view of its dtype's block at a cache-line boundary, none overlapping, and a
    state of several dtypes round-trips through torch.save (which refuses one storage as two dtypes)."""
    host = snapshot.HostBlock(SPECS, lock=False)
    assert [(tuple(v.shape), v.dtype) for v in host.views] == [(tuple(s), d) for s, d in SPECS]
    assert set(host.blocks) == {d for _, d in SPECS}
    for view in host.views:
        base = host.blocks[view.dtype].data_ptr()
        assert view.data_ptr() >= base and (view.data_ptr() - base) % snapshot.ALIGN == 0
    # each block on pages of its own: the driver locks whole pages, and refuses a page twice
    pages = [
        range(b.data_ptr() // snapshot.PAGE, -(-(b.data_ptr() + b.numel() * b.element_size()) // snapshot.PAGE))
        for b in host.blocks.values()
    ]
    assert all(b.data_ptr() % snapshot.PAGE == 0 for b in host.blocks.values())
    assert all(not set(a) & set(b) for i, a in enumerate(pages) for b in pages[i + 1 :])
    for index, view in enumerate(host.views):
        view.fill_(index + 1)
    for index, view in enumerate(host.views):
        assert bool((view == (index + 1 if view.dtype != torch.bool else True)).all()), index

    writer = snapshot.StateWriter(torch.device("cpu"))
    model = {"w": torch.arange(10.0), "b": torch.ones(3), "n": torch.tensor(7), "h": torch.ones(2).half()}
    state = {"step": 3, "model": model}
    writer.submit(state, [checkpoint.persist(tmp_path, 3, keep=1, best=False, log=lambda line: None)])
    writer.close()
    assert len({b.untyped_storage().data_ptr() for b in writer.buffers}) == 3  # float32, int64, float16
    saved = checkpoint.load_latest(tmp_path)
    assert all(torch.equal(saved["model"][key], model[key]) for key in model)
    # a CPU trainer's optimizer keeps what it loads: owned() gives each tensor a storage of its own size
    assert saved["model"]["w"].untyped_storage().nbytes() > saved["model"]["w"].nbytes
    own = snapshot.owned(saved["model"])
    assert all(t.untyped_storage().nbytes() == t.nbytes and torch.equal(t, model[k]) for k, t in own.items())


class _Cudart:
    """The driver's two calls, recorded (no GPU here; scripts/bench_gpu.py times the real ones)."""

    def __init__(self, register_error: int = 0):
        self.calls: list = []
        self.register_error = register_error

    def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:
        self.calls.append(("register", pointer, size, flags))
        return self.register_error

    def cudaHostUnregister(self, pointer: int) -> int:
        self.calls.append(("unregister", pointer))
        return 0


def _fake_driver(monkeypatch, cudart: _Cudart) -> None:
    def check_error(code: int) -> None:
        if code:
            raise RuntimeError(f"CUDA error: {code}")

    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "check_error", check_error)


def test_a_gpu_writer_page_locks_its_block_in_one_call_and_unlocks_it_before_it_is_freed(monkeypatch):
    cudart = _Cudart()
    _fake_driver(monkeypatch, cudart)
    host = snapshot.HostBlock(SPECS, lock=True)
    blocks = [b for b in host.blocks.values() if b.numel()]  # the bool block is empty: nothing to lock
    whole_pages = [-(-b.numel() * b.element_size() // snapshot.PAGE) * snapshot.PAGE for b in blocks]
    assert sorted(cudart.calls) == sorted(("register", b.data_ptr(), n, 0) for b, n in zip(blocks, whole_pages))
    assert len(cudart.calls) == len(blocks) == len({d for s, d in SPECS if torch.Size(s).numel()})
    host.release()
    host.release()  # once only
    assert sorted(cudart.calls[len(blocks) :]) == sorted(("unregister", b.data_ptr()) for b in blocks)
    assert not host.locked


def test_a_gpu_writer_reserves_pageable_buffers_unless_asked_to_page_lock_them(monkeypatch):
    """Session 23 on an H100: the trainer holding its state page-locked ran 1.28x the plain loop on the
    same steps, 1.05x holding none. A GPU writer's buffers are pageable unless asked (the driver's calls
    recorded; the stream is a stand-in, no GPU here)."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    state = {"w": torch.ones(3, 5), "n": torch.tensor(7)}
    for lock, registers in ((None, 0), (False, 0), (True, 2)):
        cudart = _Cudart()
        _fake_driver(monkeypatch, cudart)
        device = torch.device("cuda")
        writer = snapshot.StateWriter(device) if lock is None else snapshot.StateWriter(device, lock=lock)
        writer.reserve(state)
        writer.flush()
        assert [call[0] for call in cudart.calls] == ["register"] * registers, lock
        assert [(tuple(b.shape), b.dtype) for b in writer.buffers] == [((3, 5), torch.float32), ((), torch.int64)]
        writer.close()
        assert [call[0] for call in cudart.calls] == ["register"] * registers + ["unregister"] * registers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream copy needs a GPU")
@pytest.mark.parametrize("lock", [False, True])
def test_on_a_gpu_the_state_written_is_the_state_when_submitted_even_if_the_next_step_changes_it(lock, tmp_path):
    model = {"w": torch.arange(1 << 20, dtype=torch.float32, device="cuda"), "n": torch.tensor(7, device="cuda")}
    expected = {key: tensor.cpu() for key, tensor in model.items()}
    writer = snapshot.StateWriter(torch.device("cuda"), lock=lock)
    writer.submit({"step": 1, "model": model}, [checkpoint.persist(tmp_path, 1, keep=1, best=False, log=print)])
    model["w"].mul_(-1.0)  # the next step's in-place update, queued at once
    writer.close()
    saved = checkpoint.load_latest(tmp_path)
    assert saved is not None and all(torch.equal(saved["model"][key], expected[key]) for key in expected)


def test_a_refused_page_lock_is_one_line_and_the_copies_stay_correct(monkeypatch, capsys):
    _fake_driver(monkeypatch, _Cudart(register_error=2))
    host = snapshot.HostBlock([((3, 5), torch.float32)], lock=True)
    assert not host.locked
    line = capsys.readouterr().out.strip()
    assert line.startswith("warning: snapshot buffers not page-locked") and "\n" not in line
    host.views[0].copy_(torch.full((3, 5), 2.0))
    assert torch.equal(host.views[0], torch.full((3, 5), 2.0))
    host.release()  # nothing to unlock


def test_loaded_optimizer_state_takes_its_parameters_layouts_and_sgd_its_buffers():
    """What a fused kernel needs after a load: each state tensor laid out like its parameter (a checkpoint's
    come back row-major), the same values; SGD's momentum buffers present (zeros where a state lacks one)."""
    conv = torch.nn.Parameter(torch.randn(8, 3, 3, 3).contiguous(memory_format=torch.channels_last))
    bias = torch.nn.Parameter(torch.randn(8))
    sgd = torch.optim.SGD([conv, bias], lr=0.1, momentum=0.9)
    saved = {
        "state": {0: {"momentum_buffer": torch.arange(216.0).view(8, 3, 3, 3)}},
        "param_groups": sgd.state_dict()["param_groups"],
    }
    sgd.load_state_dict(saved)
    assert sgd.state[conv]["momentum_buffer"].stride() != conv.stride()  # what torch's load gives
    checkpoint.settle_optimizer_state(sgd)
    moved = sgd.state[conv]["momentum_buffer"]
    assert moved.stride() == conv.stride() and torch.equal(moved, torch.arange(216.0).view(8, 3, 3, 3))
    assert torch.equal(sgd.state[bias]["momentum_buffer"], torch.zeros(8))  # none saved for it: zeros
    adam = torch.optim.Adam([conv], lr=0.1)
    adam.load_state_dict(
        {
            "state": {
                0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(8, 3, 3, 3), "exp_avg_sq": torch.ones(8, 3, 3, 3)}
            },
            "param_groups": adam.state_dict()["param_groups"],
        }
    )
    checkpoint.settle_optimizer_state(adam)
    assert all(adam.state[conv][key].stride() == conv.stride() for key in ("exp_avg", "exp_avg_sq"))
    assert "momentum_buffer" not in adam.state[conv] and adam.state[conv]["step"].dim() == 0
