"""`fab drill` without a cluster: bad options and the drills not safe on AWS are one line and touch
nothing; the outcome detection and the printed timeline / goodput lost from scripted phases."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import REPO
from test_fabfile import closed_port, fab

from cluster_node.protocol.phases import Phase
from cluster_node.protocol.rundir import Restart
from cluster_node.supervisor import goodput
from clusterops.inventory import Inventory, Node, SshSettings
from clusterops.run import drill, drillreport


def _inventory(tmp_path, source: str, nodes: int = 3) -> Inventory:
    (tmp_path / "known_hosts").write_text("")
    proxy = "false %h %p" if source == "aws" else None  # access=ssm skips the EC2 lookup; this one never connects
    return Inventory(
        cluster="dr",
        source=source,
        nodes=[Node(rank=r, name=f"node{r}", public_ip="127.0.0.1", private_ip=f"10.0.0.{r}") for r in range(nodes)],
        gpus_per_node=1,
        ssh=SshSettings("root", closed_port(), str(tmp_path / "key"), str(tmp_path / "known_hosts"), proxy),
        data_dir=str(tmp_path / "data"),
    )


@pytest.fixture
def saved(tmp_path, monkeypatch):
    def save(source: str, nodes: int = 3) -> Inventory:
        inventory = _inventory(tmp_path, source, nodes)
        inventory.save(tmp_path / "inventory.json")
        return inventory

    monkeypatch.setenv("GPU_CLUSTER_INVENTORY", str(tmp_path / "inventory.json"))
    monkeypatch.chdir(REPO)
    return save


@pytest.mark.parametrize(
    "args, text",
    [
        ([], "give a drill: `fab drill KIND`, KIND one of kill-node, cut-link, slow-link, stop-rank, spot, fill-data"),
        (["nope"], "invalid drill 'nope': one of kill-node, "),
        (["kill-node", "--node", "x"], "invalid --node x: no such node (the nodes: 0=node0, 1=node1, 2=node2)"),
        (["kill-node", "--node", "3"], "invalid --node 3: no such node"),
        (["kill-node", "--node", "0"], "drill kill-node on node0 would take the supervisor with it"),
        # issue 32 §11: a name, as fab train --exclude takes it (was: "a whole number")
        (["kill-node", "--node", "node0"], "drill kill-node on node0 would take the supervisor with it"),
        (["cut-link", "--node", "0"], "drill cut-link on node0 would take the supervisor with it"),
        (["slow-link", "--rate", "fast"], "invalid --rate 'fast': a tc rate such as 10mbit"),
        (["fill-data", "--mb", "0"], "invalid --mb 0: 1 to 65536"),
        (["fill-data", "--seconds", "0"], "invalid --seconds 0 / --wait 180: 1-600 and 1-1800 seconds"),
        (["stop-rank", "--wait", "soon"], "invalid --wait 'soon': a number"),
    ],
)
def test_bad_options_are_one_line_and_touch_no_node(args, text, saved, capsys):
    saved("local")  # its one reachable-looking node refuses SSH: any connection would be a second error
    code = fab("drill", *args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: ") and text in err[-1], err
    assert not any(line.startswith("drill: ") for line in err)  # the injection was never announced


@pytest.mark.parametrize("kind", [k for k in drill.KINDS if k not in drill.AWS_SAFE])
def test_drills_not_safe_on_aws_are_refused_in_one_line(kind, saved, capsys):
    saved("aws")
    code = fab("drill", kind)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: drill {kind} is not run on AWS: {drill.AWS_REFUSALS[kind]}; rehearse it")


def test_stop_rank_passes_on_aws_and_then_needs_the_node(saved, capsys):
    saved("aws")
    code = fab("drill", "stop-rank")
    err = capsys.readouterr().err
    assert code == 1 and "drill: stop-rank: injecting" in err and "error: SSH: " in err, err


def test_one_node_has_nothing_to_carry_on_but_can_fill_data(tmp_path):
    one = _inventory(tmp_path, "local", nodes=1)
    with pytest.raises(drill.DrillError, match="needs 2 nodes or more"):
        drill.validate(drill.Drill("stop-rank"), one)
    drill.validate(drill.Drill("fill-data"), one)
    assert drill.Drill("spot").target(_inventory(tmp_path, "local")) == 2  # the last node by default


MARKS = [
    Phase("run", 100.0),
    Phase("launch", 100.5),
    Phase("process", 101.0),
    Phase("rendezvous", 102.0),
    Phase("ready", 103.0, step=0),
    Phase("first_step", 104.0, step=1),
    Phase("steps", 110.0, step=10),
    Phase("checkpoint", 110.0, end=110.5, step=10),
    Phase("steps", 116.0, step=20),
    # the drill at 117: node2 killed
    Phase("detect", 120.0, end=116.5, step=20, kind="unreachable"),
    Phase("decide", 125.0, step=10, kind="unreachable"),
    Phase("launch", 125.1),
    Phase("process", 126.0),
    Phase("rendezvous", 127.0),
    Phase("ready", 128.0, step=10),
    Phase("first_step", 129.0, step=11),
]


def test_the_supervisor_has_acted_once_a_relaunch_steps_or_the_run_is_done():
    assert drill.acted(MARKS[:-1], 117.0) is None
    assert drill.acted(MARKS, 117.0) == "relaunched"
    assert drill.acted([*MARKS, Phase("done", 140.0)], 117.0) == "ended"
    assert drill.acted(MARKS, 130.0) is None  # before the drill: not its doing


def test_the_timeline_and_the_goodput_lost_from_the_phases():
    shown = drillreport.timeline(MARKS, 117.0)
    assert shown[0] == "  +0.0 s  injected"
    assert "  +3.0 s  supervisor detected the failure (unreachable); its last heartbeat: step 20" in shown
    assert "  +8.0 s  supervisor decided: restart from step 10" in shown
    assert "  +8.1 s  supervisor launched attempt 2" in shown and shown[-1] == "  +12.0 s  first step (11)"
    lost = drillreport.lost(MARKS, 117.0, 129.0)
    # 12 s of drill, none of it kept stepping; the 6 s stepped after the checkpoint are recomputed; and the
    # 0.5 s from the last heartbeat to the injection, stepping then, is detection now
    assert lost[0].startswith("goodput lost: 18.5 s (") and lost[0].endswith(
        " in the drill's 12.0 s; the run's goodput 74% -> 21%"
    )
    assert "recomputed 6.0 s" in lost[0] and "restart.detect 3.5 s" in lost[0]
    assert lost[1].startswith("incident (unreachable): detected 3.5 s after the last step, decided in 5.0 s")
    assert lost[1].endswith("10 steps lost (6.0 s to recompute)")


def test_a_restart_before_any_checkpoint_says_from_the_start_not_step_none():
    """The new-user walk: "restart from the checkpoint at step None", "from step None"."""
    marks = [Phase("decide", 125.0, step=None, kind="died")]
    assert (
        drillreport.timeline(marks, 117.0)[-1]
        == "  +8.0 s  supervisor decided: restart from the start (no checkpoint or snapshot yet)"
    )
    restart = Restart.from_json(RESTART)
    assert drillreport._from(replace(restart, resume_step=None)) == "from the start (no checkpoint or snapshot yet)"
    assert drillreport._from(restart) == "from the checkpoint at step 7"
    snapshot = replace(restart, resume_step=18, resume_from="snapshot", steps_lost=2, lost_s=1.25)
    assert drillreport._from(snapshot) == "from the nodes' own snapshots at step 18; lost 2 steps, 1.2 s"
    copied = drillreport._from(replace(snapshot, resume_holder="10.0.0.2"))
    assert copied == "from node1's snapshot (copied to /data) at step 18; lost 2 steps, 1.2 s"


RESTART = {
    "time": "2026-11-26T10:00:00Z",
    "kind": "unreachable",
    "reason": "node2 unreachable",
    "nodes_before": ["10.0.0.1", "10.0.0.2", "10.0.0.3"],
    "nodes_after": ["10.0.0.1", "10.0.0.2"],
    "dropped": {"10.0.0.3": "unreachable"},
    "rejoined": [],
    "resume_step": 7,
    "global_batch": 24,
    "batch_per_gpu": 12,
    "grad_accum": 1,
    "max_batch_per_gpu": 8,
    "names": {"10.0.0.1": "node0", "10.0.0.2": "node1", "10.0.0.3": "node2"},
}


def test_a_restart_from_a_snapshot_recomputes_only_the_steps_after_its_copy():
    """Issue 30: the same drill, the survivors holding a snapshot at step 18 (taken at 114.0): the steps
    from 18 to 20 are recomputed, not those since the checkpoint at 10; the copy's stall is a checkpoint cost."""
    marks = [*MARKS[:5], Phase("snapshot", 114.0, end=114.1, step=18), *MARKS[5:7]]
    marks += [Phase("decide", 125.0, step=18, kind="unreachable"), *MARKS[8:]]
    lost = drillreport.lost(marks, 117.0, 129.0)
    # recomputed: from the snapshot's copy (114.1) to the last heartbeat (116.5); the copy was before the drill
    assert "recomputed 2.4 s" in lost[0] and "checkpoint.snapshot" not in lost[0], lost
    assert lost[1].endswith("2 steps lost (2.4 s to recompute)"), lost
    acc = goodput.account(marks, now=129.0)
    assert acc is not None and acc.phases["checkpoint.snapshot"] == pytest.approx(0.1)
    assert any("checkpoint: " in line and "(snapshot 0.1 s)" in line for line in goodput.lines(acc))


def test_a_drill_without_restarts_reports_no_restart_or_recomputed_time():
    """Issue 32 §11: without --max-restarts the run ends at the detection: its goodput said "restart.detect"
    and "recomputed" seconds that never happened."""
    ended = [*MARKS[: MARKS.index(Phase("detect", 120.0, end=116.5, step=20, kind="unreachable")) + 1]]
    ended.append(Phase("done", 120.5, kind="unreachable"))
    lost = drillreport.lost(ended, 117.0, 121.0)
    assert "restart" not in lost[0] and "recomputed" not in lost[0] and "shutdown" in lost[0], lost
    assert len(lost) == 1  # no incident line: nothing was restarted


def test_routine_checkpoints_after_the_first_two_are_counted_not_listed():
    marks = [Phase("launch", 100.0), *(Phase("checkpoint", 101.0 + i, end=101.5 + i, step=10 * i) for i in range(5))]
    shown = drillreport.timeline(marks, 100.5)
    listed = ["  +0.5 s  checkpoint at step 0", "  +1.5 s  checkpoint at step 10"]
    assert shown[1:] == [*listed, "  (and 3 more checkpoints)"]


def test_the_refusals_reason_holds_the_container_gets_no_net_admin():
    """cut-link and slow-link are refused on AWS because the container cannot run tc or `ip link`: Docker's
    default capabilities lack NET_ADMIN (Docker run reference, "Runtime privilege and Linux capabilities")
    and the bootstrap adds only SYS_PTRACE. Should it ever add more, these refusals need another look."""
    bootstrap = (REPO / "assets" / "bootstrap" / "node-bootstrap.sh").read_text()
    assert "--cap-add SYS_PTRACE" in bootstrap
    assert "NET_ADMIN" not in bootstrap and "--privileged" not in bootstrap and "cap-add ALL" not in bootstrap


def test_stop_rank_stops_one_rank_the_oldest_never_mpirun(tmp_path):
    """On a multi-GPU node `pgrep -f` found every rank and, on the head node, mpirun (its line holds the
    trainer's): the drill's pattern and `pgrep -o` pick one rank, the oldest (real pgrep, real processes)."""
    import os
    import subprocess
    import time

    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "__init__.py").write_text("")
    (tmp_path / "train" / "train.py").write_text("import time\ntime.sleep(30)\n")
    (tmp_path / "mpirun").write_text("#!/bin/sh\nsleep 30\n")
    (tmp_path / "mpirun").chmod(0o755)
    rank = ["python3", "-m", "train.train", "--recipe", "transformer-tiny"]
    started = [subprocess.Popen(["./mpirun", "-x", "PYTHONPATH=/workspace", *rank], cwd=tmp_path)]
    try:
        for _ in range(2):
            time.sleep(0.2)
            started.append(subprocess.Popen(rank, cwd=tmp_path))
        time.sleep(0.5)
        mine = ["pgrep", "-P", str(os.getpid()), "-f", drill.RANK_PATTERN]
        every = subprocess.run(mine, capture_output=True, text=True).stdout.split()
        assert sorted(map(int, every)) == [p.pid for p in started[1:]]  # both ranks, not mpirun
        oldest = subprocess.run([*mine[:1], "-o", *mine[1:]], capture_output=True, text=True).stdout.split()
        assert oldest == [str(started[1].pid)]
    finally:
        for process in started:
            process.kill()
            process.wait()
