"""The run-directory records against the files the training program writes: progress.json from the
trainer's own writer (both shapes), summary.json and progress.json from a real two-step run, the rank
heartbeat the trainer's callback writes, and prepare.py's busy marker. Runs on the image's torch too
(tests/trainer_tests.txt)."""

from __future__ import annotations

import faulthandler
import json
import signal
import threading

import pytest
import torch
from test_training import train as run_trainer

from cluster_node.protocol import rundir
from train import callbacks, distributed, prepare
from train.config import build_parser, config_from_args
from train.train import compose


def test_progress_reads_both_shapes_the_trainer_writes(tmp_path):
    writer = callbacks.ProgressFile(tmp_path, max_steps=10, world_size=2)
    path = tmp_path / rundir.PROGRESS
    writer.on_progress(4, dict(loss=2.5, avg_step_time_s=0.1, breakdown={"data_s": 0.01}, elapsed_s=1.0, eta_s=0.6))
    logged = rundir.read_record(path, rundir.Progress)
    assert logged is not None and logged.to_json() == json.loads(path.read_text()) and not logged.extra
    assert (logged.step, logged.max_steps, logged.world_size, logged.ended) == (4, 10, 2, None)
    writer.on_progress(4, dict(loss=None, avg_step_time_s=0.1, ended="max_steps"))
    final = rundir.read_record(path, rundir.Progress)
    assert final is not None and final.to_json() == json.loads(path.read_text())
    assert final.loss is None and final.ended == "max_steps" and "loss" in final.to_json()


SUMMARY_KEYS = {"recipe", "steps", "world_size", "global_batch", "objects", "avg_step_time_s", "objects_per_s"}
SUMMARY_KEYS |= {"warmup", "flops_per_step", "mfu", "mfu_peak", "batch_shapes", "checkpoint_mb", "precision"}
SUMMARY_KEYS |= {"grad_compression", "resumed_from", "ended", "wall_time_s", "breakdown", "calibration"}
SUMMARY_KEYS |= {"auto_compression"}


def test_a_real_run_writes_records_the_module_reads(numbers_data, tmp_path):
    out = run_trainer(numbers_data, tmp_path, "--max-steps", "2", "--log-every", "1").stdout
    # Issue 32 §7: step 1's speed, parts and ETA (start-up) misled: "208 ms/step ... compute 877"
    [first] = [line for line in out.splitlines() if "step 1/2 " in line]
    assert "first step" in first and "ms/step" not in first and "| ETA" not in first, first
    assert "| lr " in first and "ms/step" in next(line for line in out.splitlines() if "step 2/2 " in line)
    assert "evaluating at step 2 (up to " in out  # issue 32 §10: the final eval was not announced
    summary = rundir.read_record(tmp_path / rundir.SUMMARY, rundir.Summary)
    assert summary is not None and summary.to_json() == json.loads((tmp_path / rundir.SUMMARY).read_text())
    assert summary.steps == 2 and summary.ended == "max_steps" and "best_bleu" in summary.metrics
    assert summary.end == rundir.EndedBy.STEPS and summary.ended_by == "steps"  # what ended it, as a value
    keys = set(json.loads((tmp_path / rundir.SUMMARY).read_text())) - {"ended_by"}
    assert keys == SUMMARY_KEYS | {
        "eval_loss",
        "bleu",
        "exact_match",
        "best_bleu",
    }  # the hand-built dict's keys, through the record
    progress = rundir.read_record(tmp_path / rundir.PROGRESS, rundir.Progress)
    assert progress is not None and progress.ended == "max_steps" and not progress.extra
    assert progress.end == rundir.EndedBy.STEPS and progress.ended_by == "steps"
    assert (tmp_path / rundir.CONFIG).is_file() and rundir.checkpoint(tmp_path, 2).is_file()
    written = (tmp_path / rundir.SUMMARY).read_text()
    run_trainer(numbers_data, tmp_path, "--max-steps", "2", "--log-every", "1")  # trains nothing
    assert (tmp_path / rundir.SUMMARY).read_text() == written  # issue 32 §1: was rewritten with zeros


def test_a_slow_heartbeat_write_never_holds_up_a_step_and_the_newest_step_is_written_next(tmp_path, monkeypatch):
    """On EFS a write is >= 2.7 ms: the training thread only hands the step over; the writer skips to the
    newest step when its write returns (here: held until the test lets it go)."""
    held, writes = threading.Event(), []

    def write(path, text):
        writes.append(rundir.RankBeat.from_text(text).step)
        held.wait(30)
        path.write_text(text)

    beat = callbacks.RankHeartbeat(tmp_path, 0, write=write)
    steps = threading.Thread(target=lambda: [beat.on_step(step) for step in range(1, 11)])
    steps.start()
    steps.join(10)
    assert not steps.is_alive(), "a step waited for the heartbeat's write"
    held.set()
    assert beat.flush()
    assert rundir.RankBeat.from_text(rundir.rank_beat(tmp_path, 0).read_text()).step == 10
    assert writes[-1] == 10 and len(writes) <= 3  # the first step, maybe one in flight, then the newest
    monkeypatch.setattr(callbacks, "HEARTBEAT_EVERY_S", 60.0)  # the pause after each write from here on
    for step in (11, 12, 13):  # a flush (before a node's snapshot) does not wait out the pause
        beat.on_step(step)
        assert beat.flush(timeout=10), step
    beat.close()


def test_a_failed_heartbeat_write_is_tried_again_even_with_no_new_step(tmp_path, capsys, monkeypatch):
    """The last step before a long eval, or the run's end, is written once the filesystem answers again;
    a rank whose writes keep failing stops (the watchdog would blame its old heartbeat in a hang)."""
    monkeypatch.setattr(callbacks, "HEARTBEAT_RETRY_S", 0.01)
    failures = [OSError(5, "Input/output error")] * 2

    def write(path, text):
        if failures:
            raise failures.pop()
        path.write_text(text)

    beat = callbacks.RankHeartbeat(tmp_path, 0, write=write)
    beat.on_step(1)
    assert beat.flush() and rundir.RankBeat.from_text(rundir.rank_beat(tmp_path, 0).read_text()).step == 1
    said = [line for line in capsys.readouterr().out.splitlines() if "heartbeat" in line]
    assert said == [
        "warning: rank heartbeat not written (try 1: OSError: [Errno 5] Input/output error)",
        "rank heartbeat written again after 2 failed tries",
    ]
    broken = callbacks.RankHeartbeat(tmp_path, 1, write=lambda path, text: 1 / 0)  # not only OSError
    broken.on_step(1)
    assert not broken.flush(timeout=0.5)
    broken.failures = callbacks.HEARTBEAT_FAILURES  # its writer thread may fail once more before on_step reads it
    with pytest.raises(OSError, match=r"rank heartbeat not written in 5\d tries in a row: ZeroDivisionError"):
        broken.on_step(2)
    broken.close(timeout=0.1)
    beat.close()


def test_a_flush_while_writes_fail_keeps_the_pause_between_tries(tmp_path, monkeypatch):
    """A snapshot's flush during an EFS outage: the retries keep their pause (a spin made 50 failed tries in
    milliseconds and stopped the rank at its next step), and a flush after close() returns at once."""
    monkeypatch.setattr(callbacks, "HEARTBEAT_RETRY_S", 0.5)
    tries = []

    def write(path, text):
        tries.append(text)
        raise OSError(116, "Stale file handle")

    beat = callbacks.RankHeartbeat(tmp_path, 0, write=write)
    beat.on_step(1)
    assert not beat.flush(timeout=1.0)
    assert 1 <= len(tries) <= 4, len(tries)  # the first try and one each 0.5 s
    beat.on_step(2)  # far from HEARTBEAT_FAILURES: the rank goes on
    beat.close(timeout=0.1)
    closed = threading.Thread(target=beat.flush)
    closed.start()
    closed.join(5)
    assert not closed.is_alive(), "a flush after close() waited for a writer that is gone"


def test_the_rank_heartbeat_is_what_the_heartbeat_callback_writes(tmp_path):
    beat = callbacks.RankHeartbeat(tmp_path, 3)
    beat.on_step(1)
    beat.on_step(2)
    beat.on_progress(2, {"ended": "max_steps"})  # the run's end: the newest step written
    text = rundir.rank_beat(tmp_path, 3).read_text()
    assert rundir.RankBeat.from_text(text).step == 2 and rundir.RankBeat.from_text(text).to_text() == text
    try:
        callbacks.stacks_on_sigusr2(tmp_path, 3)
    finally:
        faulthandler.unregister(signal.SIGUSR2)
    assert (tmp_path / rundir.STACKS / rundir.RANK_STACK.format(rank=3)).exists()


def test_the_trainer_calls_its_callbacks_each_step_and_at_log_steps_and_the_end(numbers_data, tmp_path):
    """The heartbeat and progress are callbacks the composition root (train.py) hands the trainer."""

    class Recorder(callbacks.Callback):
        def __init__(self):
            self.steps, self.progress = [], []

        def on_step(self, step):
            self.steps.append(step)

        def on_progress(self, step, values):
            self.progress.append((step, values.get("ended")))

    args = ["--recipe", "transformer-tiny", "--data", str(numbers_data), "--run-dir", str(tmp_path)]
    args += ["--max-steps", "3", "--log-every", "2", "--batch-per-gpu", "4", "--eval-samples", "4"]
    config = config_from_args(build_parser("").parse_args(args))
    recorder = Recorder()
    trainer = compose(config, distributed.DistInfo(), torch.device("cpu"), [recorder])
    trainer.fit()
    assert recorder.steps == [1, 2, 3]
    assert recorder.progress == [(1, None), (2, None), (3, "max_steps")]


def test_the_busy_marker_is_what_prepare_writes(tmp_path):
    with prepare.busy_marker(str(tmp_path), "prepare.py numbers"):
        [path] = tmp_path.glob("*.json")
        marker = rundir.read_record(path, rundir.BusyMarker)
    assert marker is not None and marker.what == "prepare.py numbers"
    assert marker.to_json() == {"what": marker.what, "time": marker.time}


def test_the_progress_after_the_first_step_has_the_speed_and_eta_of_the_recent_steps(tmp_path):
    """Issue 32 §7: `fab status` kept step 1's 1,715 ms/step and its ETA of 16m40s while the run did
    1.37 s/step. Step 1 logs no speed (start-up); the refreshes between log steps take the recent steps'."""
    now = [1000.0]
    writer = callbacks.ProgressFile(tmp_path, max_steps=600, world_size=2, clock=lambda: now[0])
    writer.on_progress(1, dict(loss=9.0, elapsed_s=1.7))  # what the trainer writes at step 1 now
    for step in range(2, 12):
        now[0] += 1.37
        writer.on_step(step)
    record = rundir.read_record(tmp_path / rundir.PROGRESS, rundir.Progress)
    assert record is not None and record.step > 1
    assert record.avg_step_time_s == pytest.approx(1.37) and record.eta_s == pytest.approx((600 - record.step) * 1.37)


def test_progress_is_refreshed_every_few_seconds_between_log_steps_without_a_collective(tmp_path):
    """fab status read a step and an ETA up to log_every steps old (25 s on the demo): rank 0 now rewrites
    progress.json from its own clock at least every REFRESH_S, keeping the last logged loss and breakdown
    (no all-reduce: a callback, rank 0 only)."""
    now = [1000.0]
    writer = callbacks.ProgressFile(tmp_path, max_steps=100, world_size=2, clock=lambda: now[0])
    path = tmp_path / rundir.PROGRESS
    writer.on_progress(10, dict(loss=2.5, avg_step_time_s=0.5, breakdown={"data_s": 0.01}, elapsed_s=5.0, eta_s=45.0))
    written = []
    for step in range(11, 30):
        now[0] += 0.5
        writer.on_step(step)
        record = rundir.read_record(path, rundir.Progress)
        assert record is not None
        written.append(record.step)
        assert now[0] - record.time <= callbacks.REFRESH_S  # never older than that
    record = rundir.read_record(path, rundir.Progress)
    assert record.step == written[-1] > 25 and record.loss == 2.5 and record.breakdown == {"data_s": 0.01}
    assert record.eta_s == (100 - record.step) * 0.5 and record.elapsed_s == 5.0 + (record.time - 1000.0)
    assert len(set(written)) <= 19 * 0.5 / callbacks.REFRESH_S + 1  # a write every REFRESH_S, not every step


EXIT_PROBE = """
from torch.utils.data import DataLoader
from train import distributed
loader = DataLoader(list(range(64)), batch_size=8, num_workers=2, persistent_workers=True)
next(iter(loader))
print("ended", flush=True)
distributed.exit_without_finalizing(0)
"""


def test_a_rank_that_ends_closes_its_output_at_once_with_dataloader_workers(tmp_path):
    """Issue 32 §10: every resnet run ended 5 s after its summary: the DataLoader workers, alive until their
    check on the parent, held the rank's stdout open and mpirun waited for its end."""
    import os
    import subprocess
    import sys
    import threading
    import time

    from conftest import TRAIN_DIR, tool_env

    rank = subprocess.Popen(
        [sys.executable, "-c", EXIT_PROBE],
        stdout=subprocess.PIPE,
        text=True,
        env=tool_env(PYTHONPATH=str(TRAIN_DIR.parent)),
        start_new_session=True,  # its group: a worker left behind is killed with it below
    )
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "ended\n"
        ended = time.monotonic()
        reader = threading.Thread(target=rank.stdout.read, daemon=True)  # returns at EOF: every holder gone
        reader.start()
        reader.join(timeout=5)
        assert not reader.is_alive(), "the rank's stdout was still open 5 s after it ended"
        assert time.monotonic() - ended < 2.0
    finally:
        os.killpg(rank.pid, signal.SIGKILL)
        rank.wait()
