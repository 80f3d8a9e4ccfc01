"""The run-directory records against the files the training program writes: progress.json from the
trainer's own writer (both shapes), summary.json and progress.json from a real two-step run, the rank
heartbeat train.py's watchable writes, and prepare.py's busy marker. Runs on the image's torch too
(tests/trainer_tests.txt)."""

from __future__ import annotations

import faulthandler
import json
import signal
from pathlib import Path
from types import SimpleNamespace

from test_training import train as run_trainer

from cluster_node import rundir
from train import prepare, train, trainer


def _progress_writer(run: Path, step: int) -> SimpleNamespace:
    info = SimpleNamespace(is_main=True, world_size=2)
    return SimpleNamespace(info=info, step=step, config=SimpleNamespace(max_steps=10), run_dir=run)


def test_progress_reads_both_shapes_the_trainer_writes(tmp_path):
    fake = _progress_writer(tmp_path, 4)
    path = tmp_path / rundir.PROGRESS
    trainer.Trainer._write_progress(
        fake, loss=2.5, avg_step_time_s=0.1, breakdown={"data_s": 0.01}, elapsed_s=1.0, eta_s=0.6
    )
    logged = rundir.read_record(path, rundir.Progress)
    assert logged is not None and logged.to_json() == json.loads(path.read_text()) and not logged.extra
    assert (logged.step, logged.max_steps, logged.world_size, logged.ended) == (4, 10, 2, None)
    trainer.Trainer._write_progress(fake, loss=None, avg_step_time_s=0.1, ended="max_steps")
    final = rundir.read_record(path, rundir.Progress)
    assert final is not None and final.to_json() == json.loads(path.read_text())
    assert final.loss is None and final.ended == "max_steps" and "loss" in final.to_json()


def test_a_real_run_writes_records_the_module_reads(numbers_data, tmp_path):
    run_trainer(numbers_data, tmp_path, "--max-steps", "2", "--log-every", "1")
    summary = rundir.read_record(tmp_path / rundir.SUMMARY, rundir.Summary)
    assert summary is not None and summary.to_json() == json.loads((tmp_path / rundir.SUMMARY).read_text())
    assert summary.steps == 2 and summary.ended == "max_steps" and "best_bleu" in summary.metrics
    progress = rundir.read_record(tmp_path / rundir.PROGRESS, rundir.Progress)
    assert progress is not None and progress.ended == "max_steps" and not progress.extra
    assert (tmp_path / rundir.CONFIG).is_file() and rundir.checkpoint(tmp_path, 2).is_file()


def test_the_rank_heartbeat_is_what_watchable_writes(tmp_path):
    fake = SimpleNamespace(step=0)

    def step():
        fake.step += 1

    fake.train_step = step
    try:
        train.watchable(fake, tmp_path, 3)
        fake.train_step()
        fake.train_step()
    finally:
        faulthandler.unregister(signal.SIGUSR2)
    beat = rundir.RankBeat.from_text(rundir.rank_beat(tmp_path, 3).read_text())
    assert beat.step == 2 and beat.to_text() == rundir.rank_beat(tmp_path, 3).read_text()
    assert (tmp_path / rundir.STACKS / rundir.RANK_STACK.format(rank=3)).exists()


def test_the_busy_marker_is_what_prepare_writes(tmp_path):
    with prepare.busy_marker(str(tmp_path), "prepare.py numbers"):
        [path] = tmp_path.glob("*.json")
        marker = rundir.read_record(path, rundir.BusyMarker)
    assert marker is not None and marker.what == "prepare.py numbers"
    assert marker.to_json() == {"what": marker.what, "time": marker.time}
