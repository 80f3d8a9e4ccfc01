"""The run lifecycle (issue 23, items 1-3 and the bad --extra of 13): two launches at once give one run and
one refusal; a resume keeps the run's saved settings and a conflicting flag is one line before anything
starts; a stopped run is `stopped` (resumable), and `fab runs` counts every segment's wall time."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from runfiles import full_status, here, run_files
from supervisor_fixture import ANSWERING_SSH, STANDINS, status, supervise, write_spec

from cluster_node.protocol import rundir
from cluster_node.protocol.spec import Limits, RunSpec
from clusterops import terminal
from clusterops.inventory import Inventory, Node, SshSettings
from clusterops.nodes import remote
from clusterops.run import analysis, launch, lifecycle, resume


def start_env(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ssh").write_text(ANSWERING_SSH)
    (bin_dir / "ssh").chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{STANDINS}:{os.environ['PATH']}", PYTHONPATH=str(REPO / "assets"))


def launch_payload(tmp_path: Path, run: Path, index: int) -> Path:
    spec = write_spec(run, [sys.executable, "-c", "import time; time.sleep(4)"])
    for name in (rundir.SPEC, rundir.SPECS):  # as fab leaves the run directory: the start writes them
        subprocess.run(["rm", "-rf", str(run / name)], check=True)
    payload = tmp_path / f"payload{index}.json"
    payload.write_text(json.dumps({"spec": spec.to_json(), "probe": "true"}))
    return payload


def test_two_launches_at_once_give_one_run_and_one_refusal(tmp_path):
    """Before: `fab train` checked for a running run, then launched, in separate round trips; two at once
    both started (cluster_node.programs.start did not exist: the check and the start were not one step)."""
    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    payloads = [launch_payload(tmp_path, run, i) for i in (1, 2)]
    lock = tmp_path / "launch.lock"
    argv = [[sys.executable, "-m", "cluster_node.programs.start", str(p), "--lock", str(lock)] for p in payloads]
    env = start_env(tmp_path)
    both = [subprocess.Popen(a, env=env, stdout=subprocess.PIPE, text=True) for a in argv]
    answers = [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1]) for p in both]
    started = [a for a in answers if "run" in a]
    refused = [a["refused"] for a in answers if "refused" in a]
    assert len(started) == 1 and len(refused) == 1, answers
    assert refused[0].startswith(f"a run is already going in {run}: ") and "\n" not in refused[0]
    assert len(list((run / rundir.SPECS).iterdir())) == 1  # the loser wrote nothing
    assert not payloads[0].exists() and not payloads[1].exists()


def test_a_run_ended_by_a_stop_request_is_stopped_and_its_segment_recorded(tmp_path):
    """Before: a stopped run's state was `finished` (`fab runs`: finished 77/300)."""
    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    end = "import json; json.dump(dict(step=77, ended='stop requested'), open('progress.json', 'w'))"
    write_spec(
        run,
        [
            sys.executable,
            "-c",
            f"import os; os.chdir({str(run)!r}); {end}; print('run ended at step 77: stop requested')",
        ],
    )
    assert supervise(run).returncode == 0
    assert status(run)["state"] == "stopped"
    (segment,) = rundir.read_list(run / rundir.SEGMENTS, rundir.Segment)
    assert segment.state == "stopped" and segment.ended >= segment.started


def test_runs_shows_stopped_and_the_wall_time_of_every_segment():
    """Before: the wall column was the last segment's summary.wall_time_s (30 s here)."""
    run = run_files(
        "tiny",
        summary={"recipe": "transformer-tiny", "steps": 77, "wall_time_s": 30.0},
        config={"max_steps": 300},
        status={"state": "stopped"},
        segments=[
            {"started": 0.0, "ended": 100.0, "state": "stopped"},
            {"started": 500.0, "ended": 560.0, "state": "stopped"},
        ],
    )
    row = analysis.run_row(run, None)
    assert (row["state"], row["steps"], row["wall"]) == ("stopped", "77/300", "2.7 min")


def inventory() -> Inventory:
    return Inventory(
        cluster="c",
        source="local",
        gpus_per_node=1,
        nodes=[Node(0, "node0", "10.0.0.1", "10.0.0.1")],
        ssh=SshSettings("root", 4444, "k", "known"),
        data_dir="/data",
    )


SPEC = RunSpec(
    run="/data/runs/tiny",
    attempt=1,
    supervisor_host="10.0.0.1",
    hosts=("10.0.0.1",),
    pool=("10.0.0.1",),
    slots=1,
    env={"MASTER_PORT": "29600"},
    process_env={},
    mpirun_options=(),
    program=(),
    ssh_config="",
    active_file="",
    python="python",
    limits=Limits(max_restarts=2, min_nodes=1, hang_floor=90.0, stall=600.0, start=900.0),
)
SAVED = resume.Saved(
    config={"recipe": "transformer-tiny", "data": "/data/datasets/numbers", "max_steps": 300, "batch_per_gpu": 32},
    spec=RunSpec.from_json(SPEC.to_json()),  # as spec.json reads back
)


def saved_config() -> dict:
    from train.config import build_parser, config_from_args

    args = build_parser("t").parse_args(
        [
            "--recipe",
            "transformer-tiny",
            "--data",
            "/data/datasets/numbers",
            "--run-dir",
            "/data/runs/tiny",
            "--max-steps",
            "300",
        ]
    )
    return config_from_args(args).to_dict()


def test_a_resume_takes_the_runs_recipe_data_and_limits_unless_given():
    """Before: fab filled in fabric.yaml's default recipe and data set and every rank refused them."""
    request = launch.TrainRequest(recipe="transformer-base", run="tiny")
    kept = resume.resumed(request, set(), SAVED, inventory())
    assert (kept.recipe, kept.data, kept.max_restarts, kept.hang_seconds, kept.master_port) == (
        "transformer-tiny",
        "/data/datasets/numbers",
        2,
        90.0,
        29600,
    )
    given = resume.resumed(
        launch.TrainRequest(recipe="transformer-base", run="tiny", max_restarts=0), {"max_restarts"}, SAVED, inventory()
    )
    assert given.max_restarts == 0


@pytest.mark.parametrize(
    "request_, given, words",
    [
        (
            launch.TrainRequest(recipe="transformer-base", run="tiny"),
            {"recipe"},
            "--recipe transformer-base differs from run tiny's transformer-tiny",
        ),
        (
            launch.TrainRequest(run="tiny", dataset="wmt16-en-de"),
            set(),
            "--dataset wmt16-en-de differs from run tiny's data",
        ),
        (
            launch.TrainRequest(run="tiny", data="/opt/dlami/nvme/numbers"),
            set(),
            "--data /opt/dlami/nvme/numbers differs from run tiny's data",
        ),
    ],
)
def test_a_resume_with_another_recipe_or_data_set_is_one_line(request_, given, words):
    with pytest.raises(launch.LaunchError) as refused:
        resume.resumed(request_, given, SAVED, inventory())
    assert words in str(refused.value) and "start a new --run" in str(refused.value)


def test_the_trainers_own_resume_checks_run_on_the_laptop():
    """Before: --batch-per-gpu on a resume was refused by every rank, after mpirun started."""
    saved = resume.Saved(saved_config(), None)
    request = resume.resumed(launch.TrainRequest(run="tiny", batch_per_gpu=7), set(), saved, inventory())
    with pytest.raises(launch.LaunchError, match=r"^--batch-per-gpu 7 differs from the run's 64: a resumed run keeps"):
        resume.check_trainer(inventory(), request, saved, 2)
    longer = resume.resumed(launch.TrainRequest(run="tiny", steps=600), set(), saved, inventory())
    resume.check_trainer(inventory(), longer, saved, 2)  # the length may change


def test_a_finished_run_is_refused_with_how_to_train_more_or_start_anew():
    """Issue 32 §1: the same `fab train` after a finished run 'resumed' it, trained nothing and rewrote
    its summary with zeros."""
    saved = dataclasses.replace(resume.Saved(saved_config(), None), step=300)
    request = resume.resumed(launch.TrainRequest(run="tiny"), set(), saved, inventory())
    max_steps = resume.check_trainer(inventory(), request, saved, 2).max_steps
    with pytest.raises(launch.LaunchError) as refused:
        resume.refuse_finished(request, saved, max_steps, ["tiny", "tiny-2"])
    words = str(refused.value)
    assert "already finished at step 300" in words and "--run tiny --steps 450" in words and "--run tiny-3" in words
    longer = resume.resumed(launch.TrainRequest(run="tiny", steps=450), set(), saved, inventory())
    resume.refuse_finished(longer, saved, resume.check_trainer(inventory(), longer, saved, 2).max_steps, ["tiny"])


def test_the_steps_checked_and_priced_are_the_trainers_on_the_launchs_ranks():
    """resnet50's step counts are for 8 x 256 images a step: on 2 nodes of 8 GPUs the trainer trains
    28,150 steps, and the budget prices those (train.config.scaled_to_world), not 56,300."""
    import test_launch

    p4d = test_launch.inventory(nodes=2, gpus=8)
    request = launch.TrainRequest(recipe="resnet50", run="r")
    assert resume.check_trainer(p4d, request, None, 2).max_steps == 28_150
    assert resume.check_trainer(p4d, request, None, 1).max_steps == 56_300
    assert resume.check_trainer(p4d, dataclasses.replace(request, steps=900), None, 2).max_steps == 900


def test_a_run_resumed_on_more_or_fewer_ranks_keeps_its_global_batch_or_is_refused_in_one_line():
    """A 2-node run resumed after a redeploy to 4 nodes trained each remaining step at twice its global batch:
    ResNet's learning rate doubled, the sample stream jumped, and the steps left cost twice as much."""
    two = dataclasses.replace(SPEC, hosts=("10.0.0.1", "10.0.0.2"), pool=("10.0.0.1", "10.0.0.2"))
    saved = resume.Saved(saved_config(), RunSpec.from_json(two.to_json()))  # 2 ranks x 64 = 128 (no world_size)
    request = resume.resumed(launch.TrainRequest(run="tiny"), set(), saved, inventory())
    wider, words = resume.keep_global_batch(request, saved, 4, 1, 8)
    assert wider.extra_args[-6:] == ("--batch-per-gpu", "32", "--grad-accum", "1", "--keep-global-batch", "128")
    assert words == (
        "its global batch 128 kept on 4 ranks instead of 2 (--batch-per-gpu 32 --grad-accum 1 --keep-global-batch 128)"
    )
    config = resume.check_trainer(inventory(), wider, saved, 4)  # the trainer's own resume check takes it
    assert config.global_batch(4) == 128
    narrower, _ = resume.keep_global_batch(request, saved, 1, 1, 8)
    assert narrower.extra_args[-6:] == ("--batch-per-gpu", "64", "--grad-accum", "2", "--keep-global-batch", "128")
    assert resume.keep_global_batch(request, saved, 2, 1, 8) == (request, "")  # the same ranks: nothing to keep
    for mine in (
        dataclasses.replace(request, extra_args=("--batch-per-gpu", "16")),
        dataclasses.replace(request, extra_args=("--grad-accum=2",)),
        dataclasses.replace(request, batch_per_gpu=16),  # fab's own flag
    ):
        assert resume.keep_global_batch(mine, saved, 4, 1, 8) == (mine, "")  # the user's own: the trainer checks it
    with pytest.raises(launch.LaunchError) as refused:
        resume.keep_global_batch(request, saved, 3, 1, 4)
    assert str(refused.value) == (
        "run tiny trained at a global batch of 128 on 2 ranks, which does not split evenly over 3: resume it with "
        "--nodes 1 or 2 or 4, or start a new --run"
    )


def test_the_ranks_a_run_trained_on_are_its_own_record_and_a_token_sized_run_moves_only_its_accumulation():
    """The second review: a launch that failed before its first step left spec.json on 4 hosts and config.json
    as trained on 2, and a --max-tokens run's batch_per_gpu sizes no batch: 64 x 4 ranks "kept" 128 x 2 while
    each step took twice the tokens."""
    four = dataclasses.replace(SPEC, hosts=tuple(f"10.0.0.{i}" for i in range(1, 5)), pool=("10.0.0.1",))
    recorded = {**saved_config(), "world_size": 2}  # train.compose writes it with the run's settings
    saved = resume.Saved(recorded, RunSpec.from_json(four.to_json()))
    request = resume.resumed(launch.TrainRequest(run="tiny"), set(), saved, inventory())
    assert resume.keep_global_batch(request, saved, 2, 1, 8) == (request, "")  # trained on 2: nothing to keep
    assert "kept on 4 ranks instead of 2" in resume.keep_global_batch(request, saved, 4, 1, 8)[1]
    tokens = resume.Saved({**recorded, "batching": "tokens", "max_tokens": 2048}, None)
    words = "over 4 with its micro-batch [(]--max-tokens[)]: resume it with --nodes 1 or 2, or start a new --run"
    with pytest.raises(launch.LaunchError, match=words):  # 2 ranks x accumulation 1 cannot be 4 x 1/2
        resume.keep_global_batch(request, tokens, 4, 1, 8)
    narrower, _ = resume.keep_global_batch(request, tokens, 1, 1, 8)
    assert narrower.extra_args[-6:] == ("--batch-per-gpu", "64", "--grad-accum", "2", "--keep-global-batch", "128")


@pytest.mark.parametrize("extra", [("--bogus",), ("--lr-scale", "abc"), ("--lr-scale", "-1")])
def test_a_bad_extra_is_one_line_from_the_trainers_parser(extra, capsys):
    """Before: argparse's usage, once per rank, after mpirun started."""
    request = launch.TrainRequest(recipe="transformer-tiny", extra_args=extra)
    with pytest.raises(launch.LaunchError) as refused:
        resume.check_trainer(inventory(), request, None, 2)
    assert "\n" not in str(refused.value) and ("lr-scale" in str(refused.value) or "--bogus" in str(refused.value))
    assert capsys.readouterr().err == ""  # no usage text


class _HereConnection:
    """A head node that is this machine: commands through invoke's local runner, files through an
    SFTP stand-in that does what paramiko's SFTPClient.get does (opens the local file, then reads)."""

    def run(self, command: str, **kwargs):
        import invoke

        return invoke.run(command, hide=True, warn=True, in_stream=False)

    def sftp(self):
        class Sftp:
            def get(self, remotepath: str, localpath: str) -> None:
                with open(localpath, "wb") as local:  # paramiko: open(localpath, "wb"), then getfo
                    local.write(Path(remotepath).read_bytes())  # FileNotFoundError, as SFTP's ENOENT

        return Sftp()


def test_fetch_brings_the_goodput_plot_and_no_empty_vocabulary_for_an_image_run(tmp_path):
    """Issue 32 §5: an image run got a 0-byte spm.model; goodput.png (fab report's) was not fetched."""
    run, data = tmp_path / "runs" / "img", tmp_path / "datasets" / "fashion-mnist"
    (run / rundir.CHECKPOINTS).mkdir(parents=True)
    data.mkdir(parents=True)
    (run / rundir.CONFIG).write_text(json.dumps({"recipe": "resnet-small", "data": str(data)}))
    (run / rundir.RUN_STATUS).write_text(json.dumps(full_status(state="finished")))
    (run / rundir.GOODPUT_PNG).write_bytes(b"\x89PNG")
    (run / rundir.CHECKPOINTS / "step_00000005.pt").write_bytes(b"pt")
    head = dataclasses.replace(here(inventory()), data_dir=str(tmp_path))
    files, _ = lifecycle.fetch_run(_HereConnection(), head, str(run), tmp_path / "home" / "img")
    names = sorted(str(f.relative_to(tmp_path / "home" / "img")) for f in files)
    assert names == ["checkpoints/step_00000005.pt", "config.json", "goodput.png", "run-status.json"]
    assert not (tmp_path / "home" / "img" / "spm.model").exists()


def test_a_fetch_keeps_the_cluster_busy_while_it_downloads(tmp_path):
    """A fresh read (session 30): fab's own SSH traffic is not use to the idle watchdog, so a download longer than
    the idle time left (50 GB at 10 MB/s: 83 min) was cut off by the cluster's stop. A fetch now keeps a busy
    marker fresh on /data, as `fab data` does; a laptop gone mid-way leaves one that goes stale."""
    from cluster_node.daemons.autostop import busy_signals

    head = dataclasses.replace(here(inventory()), data_dir=str(tmp_path))
    busy = tmp_path / ".cluster" / "busy"
    with lifecycle.busy_while(_HereConnection(), head, "fab fetch r", every=0.2):
        (marker,) = busy.glob("*.json")
        assert busy_signals.preparing(tmp_path, time.time()) == ("fab fetch r",)
        os.utime(marker, (time.time() - 3600, time.time() - 3600))
        time.sleep(0.6)
        assert time.time() - marker.stat().st_mtime < 2  # refreshed meanwhile
    assert list(busy.glob("*.json")) == []
    run = tmp_path / "runs" / "r"
    (run / rundir.CHECKPOINTS).mkdir(parents=True)
    (run / rundir.CONFIG).write_text(json.dumps({"recipe": "resnet-small"}))
    (run / rundir.RUN_STATUS).write_text(json.dumps(full_status(state="finished")))
    (run / rundir.CHECKPOINTS / "step_00000005.pt").write_bytes(b"pt")
    seen = []

    class Watched(_HereConnection):
        def sftp(self):
            inner = super().sftp()

            class Sftp:
                def get(self, remotepath: str, localpath: str) -> None:
                    seen.append(busy_signals.preparing(tmp_path, time.time()))
                    inner.get(remotepath, localpath)

            return Sftp()

    lifecycle.fetch_run(Watched(), head, str(run), tmp_path / "home" / "r")
    assert seen and all(found == ("fab fetch r",) for found in seen) and list(busy.glob("*.json")) == []


def test_fab_stop_says_what_it_waits_for_while_it_waits(tmp_path):
    """Issue 32 §9: `fab stop` was silent for 30 s while an eval ran first."""
    run = tmp_path / "runs" / "r"
    (run / rundir.RANKS).mkdir(parents=True)
    (run / rundir.RUN_STATUS).write_text(json.dumps(full_status(state="running")))
    (run / rundir.CONFIG).write_text(json.dumps({"eval_every": 10, "max_steps": 100}))
    rundir.rank_beat(run, 0).write_text("20 123 node0\n")
    said: list[str] = []
    with pytest.raises(remote.RemoteError, match="did not stop within 3 s"):
        lifecycle.request_stop(_HereConnection(), here(inventory()), str(run), wait=3, say=said.append, every=1)
    assert said and said[0].startswith("stop: still waiting (") and "rank 0 is in the eval after step 20" in said[0]
    assert (run / rundir.STOP).exists()


def test_follow_ends_when_the_supervisor_is_gone_without_a_final_status(tmp_path):
    """A fresh read (session 30): a head node lost without a Spot notice (notices are best effort), or a killed
    supervisor, leaves run-status.json `running` for good: `--follow` printed "... at step N" forever."""
    import io
    import threading

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / rundir.RUN_STATUS).write_text(json.dumps(full_status(state="running")))
    (run / rundir.PROGRESS).write_text(json.dumps({"step": 7, "max_steps": 60}))
    (run / rundir.TRAIN_LOG).write_text("step 1/60 (1%) | loss 7.2\n")
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now; and this process's own: a new container gave the pid to another
    for pid in (gone.pid, os.getpid()):
        (run / rundir.LAUNCHER_PID).write_text(f"{pid}\n")
        with pytest.raises(remote.RemoteError) as ended:
            lifecycle.follow_log(
                _HereConnection(), here(inventory()), str(run), out=io.StringIO(), poll=0.1, timeout=15, quiet_s=0.3
            )
        assert str(ended.value) == (
            f"the supervisor of {run} on the head node is gone without a final status (its node restarted, or it "
            "was killed): `fab train --run r` continues from its checkpoint"
        )
    # a supervisor alive (its module in its command line): a quiet run is followed, not ended
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(20)", lifecycle.SUPERVISOR_MODULE])
    while lifecycle.SUPERVISOR_MODULE.encode() not in Path(f"/proc/{alive.pid}/cmdline").read_bytes():
        time.sleep(0.01)  # until it has exec'd: before, its command line is this process's
    (run / rundir.LAUNCHER_PID).write_text(f"{alive.pid}\n")
    finished = json.dumps(full_status(state="finished"))
    threading.Timer(1.5, (run / rundir.RUN_STATUS).write_text, [finished]).start()
    out = io.StringIO()
    try:
        ended_well = lifecycle.follow_log(
            _HereConnection(), here(inventory()), str(run), out=out, poll=0.1, quiet_s=0.3
        )
    finally:
        alive.kill()
    assert ended_well and ended_well.state == "finished" and "  ... at step 7/60 (" in out.getvalue()


def test_fab_stop_says_the_nodes_go_on_billing_unless_the_run_stops_them():
    """A fifth read of the real path: after `fab stop` on AWS the nodes stay up, billed, until the idle watchdog
    (default 60 min) stops them; nothing said so. A run launched with --then-stop stops them itself."""
    aws = dataclasses.replace(inventory(), source="aws", usd_per_hour=0.752)
    stopped = run_files(status={"state": "stopped"}).status
    line = terminal.after_stop_line(aws, stopped)
    assert line and line.startswith("the nodes keep running, billed (1 x $0.752/h), until the idle watchdog")
    assert line.endswith("or `fab stop-cluster` now")
    assert "--then-stop" in (terminal.after_stop_line(aws, None) or "")  # --force: the end is not read yet
    then_stop = run_files(status={"state": "stopped", "then_stop": "stopping"}).status
    assert terminal.after_stop_line(aws, then_stop) == terminal.then_stop_line(then_stop)
    assert terminal.then_stop_line(then_stop) == "the cluster is stopping (--then-stop): `fab start` brings it back"
    assert terminal.after_stop_line(inventory(), stopped) is None  # the emulated cluster bills nothing


class _ThreeNodes(_HereConnection):
    """The head node is this machine; the others are reached over the cluster's SSH, here their commands run on
    this machine with their own disk's folder in place of the head's (tmp/nodeN for tmp/node0)."""

    def __init__(self, root: Path):
        self.root = root

    def run(self, command: str, **kwargs):
        if command.startswith("timeout 20 ssh -F "):
            *_, address, inner = shlex.split(command)
            command = inner.replace(str(self.root / "node0"), str(self.root / f"node{address.rsplit('.', 1)[1]}"))
        return super().run(command, **kwargs)


def test_a_run_from_each_nodes_own_copy_needs_the_same_finished_staging_on_every_node(tmp_path):
    """A fresh read (session 30): `fab data --stage-to PATH --all-nodes` copied ImageNet to each node's NVMe, and
    nothing could train from it; `fab train --data PATH` now does, once every node of the run holds the same
    finished staging (each rank reads its own node's copy); after a stop erased the instance store, the line says
    to stage again, not to copy the data onto /data."""
    nodes = [Node(r, f"node{r}", f"10.0.0.{r}", f"10.0.0.{r}") for r in range(3)]
    inv = dataclasses.replace(inventory(), nodes=nodes)
    data = str(tmp_path / "node0" / "imagenet")
    marker = json.dumps({"files": 12, "bytes": 1300, "source": "/data/datasets/imagenet"})
    for rank in range(3):
        (tmp_path / f"node{rank}" / "imagenet" / "train").mkdir(parents=True)
        (tmp_path / f"node{rank}" / "imagenet" / ".staged.json").write_text(marker)
    check = lambda: lifecycle._check_copies(_ThreeNodes(tmp_path), inv, nodes, data, "imagenet")  # noqa: E731
    check()
    (tmp_path / "node2" / "imagenet" / ".staged.json").unlink()  # its staging was cut off (a full disk)
    with pytest.raises(remote.RemoteError, match=r"copies at .* differ \(no finished staging on node2\): each node"):
        check()
    (tmp_path / "node2" / "imagenet" / ".staging").touch()  # and says so: a staging cut off, marked at its start
    with pytest.raises(remote.RemoteError, match=r"imagenet holds a staging cut off on node2: each node's own copy"):
        check()
    for rank in range(3):  # copied by hand (no staging's markers at all): each node's copy, as it is
        for name in (".staging", ".staged.json"):
            (tmp_path / f"node{rank}" / "imagenet" / name).unlink(missing_ok=True)
    check()
    shutil.rmtree(tmp_path / "node1")  # a stop erased node1's instance store
    with pytest.raises(remote.RemoteError) as missing:
        check()
    assert str(missing.value) == (
        f"{data} is missing on node1: each node's own copy (a stop erases the instance store): stage it on every "
        f'node with `fab data --dataset imagenet --extra "--stage-to {data}" --all-nodes`'
    )
    assert launch.on_each_node(inv, "/opt/dlami/nvme/imagenet") and not launch.on_each_node(inv, "/data/datasets/x")


@pytest.mark.parametrize("bad", ["opt/dlami/nvme/imagenet", "/opt/../data", "/opt/my data", "/opt/$(id)"])
def test_data_is_an_absolute_path_of_plain_names(bad):
    with pytest.raises(launch.LaunchError, match=r"^invalid --data .*: an absolute path on the nodes"):
        launch.TrainRequest(recipe="resnet50", data=bad).validate()
    launch.TrainRequest(recipe="resnet50", data="/opt/dlami/nvme/imagenet/").validate()


def test_follow_says_where_a_quiet_run_is(tmp_path):
    """Issue 32 §10: --follow on Ding was silent for 33 s and 52 s between log lines."""
    import io
    import threading

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / rundir.RUN_STATUS).write_text(json.dumps(full_status(state="running")))
    (run / rundir.PROGRESS).write_text(json.dumps({"step": 7, "max_steps": 60}))
    (run / rundir.TRAIN_LOG).write_text("step 1/60 (1%) | loss 7.2\n")
    # Generous: on a loaded 2-core machine one poll (a status read and a tail) can take a second.
    finish = threading.Timer(4.0, (run / rundir.RUN_STATUS).write_text, [json.dumps(full_status(state="finished"))])
    finish.start()
    out = io.StringIO()
    status = lifecycle.follow_log(
        _HereConnection(), here(inventory()), str(run), out=out, poll=0.2, timeout=30, quiet_s=1.0
    )
    finish.join()
    assert status and status.state == "finished" and out.getvalue().startswith("step 1/60 (1%) | loss 7.2\n")
    # The quiet time is what the poll measured: 1 s at the earliest, more when a poll ran late.
    assert re.search(r"^  \.\.\. at step 7/60 \(\d+ s without a log line\)$", out.getvalue(), re.M), out.getvalue()
