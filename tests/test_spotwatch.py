"""The Spot interruption watcher against a fake IMDSv2 endpoint (a real HTTP server on 127.0.0.1 that
rejects GETs without the session token), and with the real trainer: notice -> checkpoint -> resume."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from conftest import tool_env
from supervisor_fixture import write_spec

from cluster_node.daemons import spotwatch
from train import checkpoint

NOTICE = {"action": "stop", "time": "2026-11-22T08:22:00Z"}


def a_run(data_dir, name="r", step=40):
    """A run the head node's launcher is running: its directory and runs/.active naming it by the
    path the head node sees (/data/...), as lifecycle.start_training writes it."""
    run = data_dir / "runs" / name
    run.mkdir(parents=True)
    (run / "progress.json").write_text(json.dumps({"step": step}))
    (data_dir / "runs" / ".active").write_text(f"/data/runs/{name}\n")
    return run


def test_a_notice_writes_stop_into_the_active_run_within_one_poll_and_records_it(fake_imds, tmp_path):
    run = a_run(tmp_path)
    fake_imds.instance_action = NOTICE
    read = lambda: spotwatch.instance_action(fake_imds.url)  # noqa: E731
    watcher = spotwatch.Watcher(tmp_path, "1", "i-0abc", read=read, host="10.0.0.6")
    line = watcher.poll(now=1_700_000_000.0)
    assert (run / "STOP").read_text().startswith("now: spot: node1 (i-0abc) will stop at 2026-11-22T08:22:00Z")
    assert json.loads((run / "interruptions.json").read_text()) == [
        {
            "node": 1,
            "instance_id": "i-0abc",
            "host": "10.0.0.6",
            "action": "stop",
            "action_time": "2026-11-22T08:22:00Z",
            "step": 40,
            "noticed": "2023-11-14T22:13:20Z",
        }
    ]
    assert "asked r to checkpoint now (last step 40); resume: fab train --run r" in line
    assert line in (run / "train.log").read_text()
    assert watcher.poll(now=1_700_000_005.0) is None  # the same notice is acted on once
    assert len(json.loads((run / "interruptions.json").read_text())) == 1
    assert [p.name for p in run.iterdir() if p.name.startswith(".interruptions.") and p.suffix == ".tmp"] == []


def test_without_a_notice_nothing_is_touched(fake_imds, tmp_path):
    run = a_run(tmp_path)
    watcher = spotwatch.Watcher(tmp_path, "0", None, read=lambda: spotwatch.instance_action(fake_imds.url))
    assert watcher.poll(now=1.0) is None
    assert sorted(p.name for p in run.iterdir()) == ["progress.json"]
    assert fake_imds.gets == [(spotwatch.ACTION_PATH, "TOKEN123")]  # asked, with the IMDSv2 token


def test_the_imdsv2_token_is_required_and_used(fake_imds):
    with pytest.raises(urllib.error.HTTPError) as refused:  # IMDSv1 style: no token
        urllib.request.urlopen(fake_imds.url + spotwatch.ACTION_PATH, timeout=2)
    assert refused.value.code == 401
    fake_imds.instance_action = {"action": "terminate", "time": "2026-11-22T08:24:00Z"}
    assert spotwatch.instance_action(fake_imds.url) == spotwatch.Notice("terminate", "2026-11-22T08:24:00Z")
    assert fake_imds.gets[-1] == (spotwatch.ACTION_PATH, "TOKEN123")


def test_a_notice_without_a_run_is_logged_and_writes_nothing(tmp_path):
    notice = spotwatch.Notice("terminate", "2026-11-22T08:24:00Z")
    line = spotwatch.handle(notice, tmp_path, "2", None, now=0.0)
    assert line == "spot: node2 will terminate at 2026-11-22T08:24:00Z; no run going"
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / ".active").write_text("/data/runs/gone\n")  # named, but removed meanwhile
    assert spotwatch.handle(notice, tmp_path, "2", None, now=0.0).endswith("; no run going")


def test_interruptions_of_several_nodes_are_all_kept(tmp_path):
    run = a_run(tmp_path)
    for rank in ("0", "1", "2"):
        spotwatch.handle(spotwatch.Notice("stop", "t"), tmp_path, rank, None, now=0.0)
    assert [e["node"] for e in json.loads((run / "interruptions.json").read_text())] == [0, 1, 2]


def test_a_notice_for_a_node_outside_the_runs_attempt_is_recorded_and_stops_nothing(tmp_path):
    """A fresh read (session 30): a notice for a node `--nodes`/`--exclude` or a restart left out wrote STOP, so
    the run ended `stopped` (and under --then-stop stopped every node) for a node it did not train on."""
    run = a_run(tmp_path)
    write_spec(run, ["true"], hosts=("10.0.0.1", "10.0.0.2"))  # the supervisor on 10.0.0.1
    notice = spotwatch.Notice("stop", "2026-11-22T08:22:00Z")
    line = spotwatch.handle(notice, tmp_path, "2", None, now=0.0, host="10.0.0.9")
    assert line.endswith("will stop at 2026-11-22T08:22:00Z; not in r's current attempt: the run goes on without it")
    assert not (run / "STOP").exists() and line in (run / "train.log").read_text()
    assert [e["host"] for e in json.loads((run / "interruptions.json").read_text())] == ["10.0.0.9"]
    spotwatch.handle(notice, tmp_path, "1", None, now=0.0, host="10.0.0.2")  # one of its ranks' nodes
    assert (run / "STOP").read_text().startswith("now: spot: node1 will stop")
    (run / "STOP").unlink()
    write_spec(run, ["true"], hosts=("10.0.0.1",))  # a restart left node1 out: its notice stops nothing
    spotwatch.handle(notice, tmp_path, "1", None, now=0.0, host="10.0.0.2")
    assert not (run / "STOP").exists()
    spotwatch.handle(notice, tmp_path, "0", None, now=0.0, host=None)  # no address known: stop, to be safe
    assert (run / "STOP").exists()


def test_the_notice_is_recorded_before_the_stop_is_appended_and_a_failed_record_still_stops(tmp_path, monkeypatch):
    """The supervisor tells a worker's notice from any other STOP by the record (loop.took_a_workers_notice): the
    record comes first; the STOP is appended, so a `fab stop` already there stays; a failed record still stops."""
    run = a_run(tmp_path)
    (run / "STOP").write_text("fab stop\n")
    seen = []
    real = spotwatch.record
    monkeypatch.setattr(spotwatch, "record", lambda r, e: seen.append((run / "STOP").read_text()) or real(r, e))
    spotwatch.handle(spotwatch.Notice("stop", "t"), tmp_path, "1", None, now=0.0, host=None)
    assert seen == ["fab stop\n"] and (run / "STOP").read_text() == "fab stop\nnow: spot: node1 will stop at t\n"
    (run / "STOP").unlink()

    def fails(r, e):
        raise OSError("EFS: stale file handle")

    monkeypatch.setattr(spotwatch, "record", fails)
    with pytest.raises(OSError):
        spotwatch.handle(spotwatch.Notice("stop", "t"), tmp_path, "1", None, now=0.0, host=None)
    assert (run / "STOP").read_text() == "now: spot: node1 will stop at t\n"


def test_a_lock_held_elsewhere_delays_the_stop_by_its_wait_at_most(tmp_path, monkeypatch):
    """A client lost while holding the lock keeps it until its NFSv4 lease expires: the notice's two minutes must
    not wait on it. The record gives up after LOCK_WAIT_S and the STOP goes out all the same."""
    run = a_run(tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.lockf(f, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(30)",
            str(run / ".interruptions.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(spotwatch, "LOCK_WAIT_S", 0.5)
        started = time.monotonic()
        with pytest.raises(OSError):
            spotwatch.handle(spotwatch.Notice("stop", "t"), tmp_path, "1", None, now=0.0, host=None)
        assert time.monotonic() - started < 5 and (run / "STOP").read_text() == "now: spot: node1 will stop at t\n"
    finally:
        holder.kill()


def test_an_unreachable_metadata_service_is_logged_once_and_polling_goes_on(tmp_path, capsys):
    watcher = spotwatch.Watcher(
        tmp_path, "0", None, read=lambda: spotwatch.instance_action("http://127.0.0.1:1", timeout=0.2)
    )
    spotwatch.watch(watcher, interval=0.0, polls=3)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "still polling" in lines[0]
    assert lines[0].startswith("spot: a poll failed (instance metadata or the run's records on /data: ")


def test_a_failed_attempt_is_retried_at_the_next_poll(tmp_path):
    run = a_run(tmp_path)
    (run / "interruptions.json").mkdir()  # unwritable for one poll
    watcher = spotwatch.Watcher(tmp_path, "0", None, read=lambda: spotwatch.Notice("stop", "t"))
    with pytest.raises(OSError):
        watcher.poll(now=0.0)
    (run / "interruptions.json").rmdir()
    assert watcher.poll(now=1.0) and len(json.loads((run / "interruptions.json").read_text())) == 1


SMALL = [
    "--recipe",
    "transformer-tiny",
    "--d-model",
    "32",
    "--ffn",
    "64",
    "--eval-samples",
    "8",
    "--log-every",
    "1",
    "--checkpoint-every",
    "1000",
    "--eval-every",
    "1000",
    "--batch-per-gpu",
    "4",
]


def test_a_notice_mid_run_checkpoints_at_the_stop_step_and_the_run_resumes_there(fake_imds, numbers_data, tmp_path):
    """The real watcher process (as entrypoint.sh starts it) and the real trainer on one CPU."""
    run = a_run(tmp_path, "spot", step=0)
    (run / "progress.json").unlink()
    env = tool_env(OMP_NUM_THREADS="1", AUTOSTOP_IMDS_URL=fake_imds.url, NODE_RANK="1", INSTANCE_ID="i-0spot")
    argv = [
        sys.executable,
        "-m",
        "train.train",
        "--data",
        str(numbers_data),
        "--run-dir",
        str(run),
        *SMALL,
        "--max-steps",
        "100000",
    ]
    trainer = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    watcher = subprocess.Popen(
        [sys.executable, "-m", "cluster_node.daemons.spotwatch", "--data", str(tmp_path), "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run / "progress.json").exists() and trainer.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        fake_imds.instance_action = NOTICE
        noticed = time.monotonic()
        out, _ = trainer.communicate(timeout=120)
        took = time.monotonic() - noticed
    finally:
        trainer.kill()
        watcher.kill()
    interruption = json.loads((run / "interruptions.json").read_text())[0]
    stopped_at = checkpoint.load_latest(run)["step"]
    assert f"run ended at step {stopped_at}: stop requested (checkpoint now, no eval)" in out, out[-2000:]
    assert "eval step" not in out and took < 60, took
    assert (interruption["node"], interruption["instance_id"], interruption["action"]) == (1, "i-0spot", "stop")
    assert interruption["step"] <= stopped_at
    resumed = subprocess.run([*argv[:-1], str(stopped_at + 2)], capture_output=True, text=True, env=env, timeout=120)
    assert f"at step {stopped_at}" in resumed.stdout and f"run ended at step {stopped_at + 2}" in resumed.stdout
    print(f"notice -> checkpoint at step {stopped_at} in {took:.1f} s")


def test_an_address_imds_did_not_give_at_start_is_asked_for_again_before_a_notice_is_recorded(tmp_path):
    """The watcher looked its address up once: an IMDS that did not answer at container start left
    every notice without a host, so a notice on the head node was never the supervisor's own (a fresh
    read of the deploy path)."""
    answers = iter([None, "10.0.0.5"])
    notices = iter([None, spotwatch.Notice("stop", "2026-11-24T08:00:00Z")])
    run = a_run(tmp_path, "r1", step=3)
    watcher = spotwatch.Watcher(tmp_path, "0", "i-0", read=lambda: next(notices), identify=lambda: next(answers))
    watcher.poll(1.0)
    watcher.poll(2.0)
    assert json.loads((run / "interruptions.json").read_text())[0]["host"] == "10.0.0.5"
