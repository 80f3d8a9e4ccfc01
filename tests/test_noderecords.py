"""clusterops.nodes.records: a run's files read on the 'head node' (this machine, through a local shell, as
over SSH) by `python -m cluster_node.programs.runs files` and decoded into cluster_node.protocol.rundir's records."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO
from runfiles import full_status, here, read_here
from test_launcher import LocalShell
from test_lifecycle import SPEC, inventory

from cluster_node.protocol import phases, rundir
from cluster_node.protocol.rundir import Progress, Restart, RunStatus, Segment, Summary
from cluster_node.protocol.spec import RunSpec
from cluster_node.supervisor.budget import Spend
from clusterops.nodes import records as noderecords
from clusterops.run import launch, lifecycle, resume

RESTART = {
    "time": "2026-01-01T00:00:05Z",
    "kind": "died",
    "reason": "rank 1 exited 1",
    "nodes_before": ["10.0.0.1", "10.0.0.2"],
    "nodes_after": ["10.0.0.1"],
    "dropped": {"10.0.0.2": "unreachable"},
    "rejoined": [],
    "resume_step": 20,
    "global_batch": 64,
    "batch_per_gpu": 32,
    "grad_accum": 2,
    "max_batch_per_gpu": 32,
}


def test_the_run_files_come_back_as_the_records_the_node_reads(tmp_path):
    """What the laptop decodes is what rundir's own readers read on the node, file by file."""
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    rundir.write_record(run / rundir.RUN_STATUS, RunStatus.from_json(full_status(state="stopped", reason="STOP")))
    rundir.write_json(run / rundir.PROGRESS, {"step": 7, "max_steps": 60, "loss": None, "eta_s": 12.0})
    rundir.write_json(run / rundir.SUMMARY, {"recipe": "transformer-tiny", "steps": 7, "bleu": 3.5})
    rundir.write_json(run / rundir.CONFIG, {"recipe": "transformer-tiny", "eval_every": 10})
    rundir.append(run / rundir.RESTARTS, Restart.from_json(RESTART))
    rundir.append(run / rundir.SEGMENTS, Segment(started=1.0, ended=5.0, state="stopped"))
    rundir.write_record(run / rundir.BUDGET, Spend(usd=5.0, spent=1.25, time=4.0))
    rundir.write_json(run / rundir.SPEC, SPEC.to_json())
    phases.mark(run, "run", when=1.0)
    found = noderecords.read(LocalShell(), here(inventory()), str(run), *noderecords.ROLES)
    assert found.run == str(run) and found.state == "stopped" and not found.running
    assert found.status == rundir.read_record(run / rundir.RUN_STATUS, RunStatus)
    assert found.progress == Progress(step=7, max_steps=60, eta_s=12.0) and found.progress.loss is None
    assert found.summary == rundir.read_record(run / rundir.SUMMARY, Summary) and found.summary.metrics == {"bleu": 3.5}
    assert found.config == {"recipe": "transformer-tiny", "eval_every": 10}
    assert found.restarts == rundir.read_list(run / rundir.RESTARTS, Restart)
    assert found.segments == (Segment(started=1.0, ended=5.0, state="stopped"),)
    assert found.spend == Spend(usd=5.0, spent=1.25, time=4.0) and found.spec == SPEC
    assert found.phases == phases.read(run) and found.hangs == () and found.interruptions == ()


def test_a_missing_run_reads_as_nothing_and_a_torn_file_as_missing_unless_strict(tmp_path):
    found = noderecords.read(LocalShell(), here(inventory()), str(tmp_path), rundir.RUN_STATUS, rundir.RESTARTS)
    assert found == noderecords.RunFiles(run=str(tmp_path)) and found.running
    (tmp_path / rundir.PROGRESS).write_text('{"step": 3')  # a writer that is not atomic, caught halfway
    assert noderecords.read(LocalShell(), here(inventory()), str(tmp_path), rundir.PROGRESS).progress is None
    with pytest.raises(noderecords.RecordsError, match=r"progress.json is not valid JSON \(Expecting"):
        noderecords.read(LocalShell(), here(inventory()), str(tmp_path), rundir.PROGRESS, strict=True)


@pytest.mark.parametrize(
    "name, value, words",
    [
        (rundir.RUN_STATUS, {"state": "finished"}, "run-status.json is not a RunStatus record (RunStatus: missing"),
        (rundir.PROGRESS, {"step": "7"}, "progress.json is not a Progress record (step: int expected, got '7')"),
        (rundir.RESTARTS, [RESTART, {"time": "t"}], "restarts.json is not a Restart record (Restart: missing"),
        (rundir.SPEC, {"run": "r"}, "spec.json is not a RunSpec record (RunSpec: 'hosts')"),
    ],
)
def test_a_file_that_is_not_its_record_is_one_error_naming_it(tmp_path, name, value, words):
    """Before: a dict read by string key, a field missing or mistyped read as absent (a renamed field too)."""
    (tmp_path / name).write_text(json.dumps(value))
    with pytest.raises(noderecords.RecordsError) as error:
        noderecords.read(LocalShell(), here(inventory()), str(tmp_path), name)
    assert str(error.value).startswith(f"{tmp_path}/{words}") and "\n" not in str(error.value)


def test_the_node_program_reads_only_run_files(tmp_path):
    bad = [sys.executable, "-m", "cluster_node.programs.runs", "files", "--run", str(tmp_path), "../../etc/passwd"]
    out = subprocess.run(bad, capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(REPO / "assets")})
    assert out.returncode == 2 and "(not ../../etc/passwd)" in out.stderr and out.stdout == ""


def test_a_resume_reads_the_saved_limits_as_a_run_spec_and_an_older_spec_as_none(tmp_path, monkeypatch):
    """Issue 31: resume read spec["limits"]["max_restarts"] from a dict; now RunSpec's limits."""
    inv = dataclasses.replace(inventory(), data_dir=str(tmp_path))
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    config = {"recipe": "transformer-tiny", "data": "/data/datasets/numbers", "max_steps": 300}
    rundir.write_json(tmp_path / "runs" / "tiny" / rundir.CONFIG, config)
    rundir.write_json(tmp_path / "runs" / "tiny" / rundir.SPEC, SPEC.to_json())
    monkeypatch.setattr(noderecords, "read", read_here)
    saved = resume.saved(LocalShell(), inv, "tiny")
    assert saved is not None and isinstance(saved.spec, RunSpec) and saved.spec.limits.max_restarts == 2
    request = resume.resumed(launch.TrainRequest(run="tiny"), set(), saved, inv)
    assert (request.max_restarts, request.hang_seconds, request.master_port) == (2, 90.0, 29600)
    rundir.write_json(tmp_path / "runs" / "tiny" / rundir.SPEC, {"limits": {"max_restarts": 5}})  # an older fab's
    older = resume.saved(LocalShell(), inv, "tiny")
    assert older is not None and older.spec is None and older.config == config
    assert resume.resumed(launch.TrainRequest(run="tiny"), set(), older, inv).max_restarts == 0  # this launch's


def test_the_latest_run_is_the_one_launched_last_not_the_one_fetched_or_reported_last(tmp_path):
    """fab logs/report/fetch without --run: the run launched last (its spec.json), though fab fetch's marker,
    fab report's files or a STOP in an older run make that run's directory the newest."""
    inv = here(dataclasses.replace(inventory(), data_dir=str(tmp_path)))
    conn = LocalShell()
    assert lifecycle.latest_run(conn, inv) is None
    older, newer = (tmp_path / rundir.RUNS / name for name in ("older", "newer"))
    for run, at in ((older, 1_000), (newer, 2_000)):
        run.mkdir(parents=True)
        (run / rundir.SPEC).write_text("{}")
        os.utime(run / rundir.SPEC, (at, at))
    (older / rundir.FETCHED).touch()  # the older directory is now the newest
    (tmp_path / rundir.RUNS / "scale-transformer-tiny").mkdir()  # fab scale's results: no spec.json, newest
    assert lifecycle.latest_run(conn, inv) == str(newer)
    os.utime(older / rundir.SPEC)  # launched again (a resume writes its spec)
    assert lifecycle.latest_run(conn, inv) == str(older)


def test_an_image_from_before_current_answers_with_its_overviews_run(tmp_path):
    """A cluster deployed by an older checkout: its image's cluster_node has no `current` (argparse: exit 2)."""
    older = tmp_path / "image"
    shutil.copytree(
        REPO / "assets" / "cluster_node", older / "cluster_node", ignore=shutil.ignore_patterns("__pycache__")
    )
    runs_py = older / "cluster_node" / "programs" / "runs.py"
    runs_py.write_text(runs_py.read_text().replace('choices=("overview", "current", ', 'choices=("overview", '))
    (older / "train").mkdir()
    data = tmp_path / "data"
    run = data / rundir.RUNS / "only"
    run.mkdir(parents=True)
    (run / rundir.RUN_STATUS).write_text(json.dumps(full_status(state="finished")))
    inv = dataclasses.replace(inventory(), data_dir=str(data), python=sys.executable, code_dir=str(older / "train"))
    assert lifecycle.latest_run(LocalShell(), inv) == str(run)
