"""The run-directory module (assets/cluster_node/protocol/rundir.py): every record round-trips, and reads what
today's writers write, made by calling those writers (the supervisor, restart_plan, hang,
spotwatch, the autostop heartbeat, fab train's launch files); the atomic write; the tolerant reads;
the protocol table names every file."""

from __future__ import annotations

import ast
import json
import os
import re
import time
from pathlib import Path

import pytest
from supervisor_fixture import write_spec
from test_launch import inventory

from cluster_node.daemons import spotwatch
from cluster_node.daemons.autostop import watchdog as autostop
from cluster_node.protocol import clusterdir, rundir, spec
from cluster_node.protocol import table as protocol
from cluster_node.supervisor import hang, restart_plan
from cluster_node.supervisor.loop import Supervisor
from clusterops.run import launch

HEALTHY = json.dumps({"time": 0, "mounted": True, "writable": True, "free_gb": 100, "xids": [], "gpus": []})

SAMPLES = [
    rundir.RunStatus(state="failed", exit_code=None, reason="watchdog: hang", time="2025-01-01T00:00:00Z", head="n0"),
    rundir.Progress(step=3, max_steps=10, time=1.5, world_size=2, loss=None, avg_step_time_s=0.2, ended="max_steps"),
    rundir.Summary(recipe="transformer-tiny", steps=30, checkpoint_mb=None, extra={"bleu": 12.5, "best_bleu": 13.0}),
    rundir.Restart(
        time="2025-01-01T00:00:00Z",
        kind="died",
        reason="rank 2 exited",
        nodes_before=("a", "b"),
        nodes_after=("a",),
        dropped={"b": "unreachable"},
        rejoined=(),
        resume_step=None,
        global_batch=16,
        batch_per_gpu=8,
        grad_accum=2,
        max_batch_per_gpu=8,
    ),
    rundir.Hang(time=1.25, rank=None, evidence="no rank wrote a heartbeat"),
    rundir.Interruption(noticed="2025-01-01T00:00:00Z", node=1, host="10.0.0.2", action="stop", action_time=""),
    rundir.NodeHeartbeat(time=5.0, busy=("run r: step moved",)),
    rundir.BusyMarker(what="prepare.py numbers", time=5.0),
    rundir.Segment(started=1.0, ended=61.0, state="stopped"),
]


def test_every_record_has_a_sample_and_survives_a_round_trip_through_a_file(tmp_path):
    assert {type(s) for s in SAMPLES} == set(rundir.RECORDS)
    for sample in SAMPLES:
        path = tmp_path / "record.json"
        rundir.write_record(path, sample)
        assert rundir.read_record(path, type(sample)) == sample
        assert type(sample).from_json(json.loads(json.dumps(sample.to_json()))) == sample


def test_unknown_keys_survive_and_a_wrong_type_or_a_missing_key_is_refused():
    status = rundir.RunStatus.from_json(
        {"state": "failed", "exit_code": 0, "reason": "r", "time": "t", "head": "h", "handoff": "node1"}
    )
    assert status.extra == {"handoff": "node1"} and status.to_json()["handoff"] == "node1"
    with pytest.raises(rundir.RecordError, match="missing reason"):
        rundir.RunStatus.from_json({"state": "running", "exit_code": None, "time": "t", "head": "h"})
    with pytest.raises(rundir.RecordError, match="step: int expected"):
        rundir.Progress.from_json({"step": "3"})
    with pytest.raises(rundir.RecordError, match="int expected"):
        rundir.Progress.from_json({"step": True})


def _shell_functions(script: Path, *names: str) -> str:
    text = script.read_text()
    return "\n".join(re.search(rf"^{name}\(\) {{.*?^}}$", text, re.M | re.S).group(0) for name in names)


@pytest.mark.parametrize("args", [("running", None, "launched"), ("failed", 137, 'it said "no" | x')])
def test_run_status_reads_what_the_supervisor_writes(tmp_path, args):
    sup = Supervisor(tmp_path, write_spec(tmp_path, ["true"]), None, None)
    sup.status(*args)
    written = json.loads((tmp_path / rundir.RUN_STATUS).read_text())
    status = rundir.read_record(tmp_path / rundir.RUN_STATUS, rundir.RunStatus)
    assert status is not None and status.to_json() == written
    assert (status.state, status.reason) == (args[0], args[2]) and status.state in rundir.STATES
    assert status.exit_code == args[1] and status.live == ("starting" if args[0] == "running" else None)


def test_restarts_read_what_restart_plan_appends(tmp_path):
    run_spec = write_spec(tmp_path, ["python"], ["10.0.0.1", "10.0.0.2"], max_restarts=2)
    (tmp_path / "config.json").write_text(json.dumps({"batch_per_gpu": 8, "grad_accum": 1}))
    (tmp_path / "probes").mkdir()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step_00000020.pt").write_bytes(b"x")
    (tmp_path / "probes" / "10.0.0.1").write_text(HEALTHY)
    for kind, reason in (("died", "rank 1 exited on signal 9"), ("hang", "rank 0 stopped")):
        plan = restart_plan.plan(tmp_path, run_spec, kind, reason)
        assert plan.spec is not None and plan.record is not None
        rundir.append(tmp_path / rundir.RESTARTS, plan.record)
        spec.write(tmp_path, plan.spec)
        run_spec = plan.spec
        (tmp_path / "probes" / "10.0.0.2").write_text(HEALTHY)
    written = json.loads((tmp_path / rundir.RESTARTS).read_text())
    restarts = rundir.read_list(tmp_path / rundir.RESTARTS, rundir.Restart)
    assert [r.to_json() for r in restarts] == written and len(restarts) == 2
    assert restarts[0].dropped == {"10.0.0.2": "unreachable"} and restarts[0].resume_step == 20
    assert restarts[1].rejoined == ("10.0.0.2",) and restarts[1].kind == "hang"
    # The spec the supervisor wrote, as the module reads it; every attempt's is kept.
    assert spec.read(tmp_path) == run_spec and run_spec.hosts == ("10.0.0.1", "10.0.0.2")
    assert spec.read(tmp_path).argv()[0] == "mpirun" and rundir.spec_record(tmp_path, 3).exists()


def test_hangs_read_what_hang_record_appends(tmp_path):
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "rank0").write_text("7 4242 node0\n")
    hang.record(tmp_path, 1.0)
    hang.record(tmp_path, 2.0)
    written = json.loads((tmp_path / rundir.HANGS).read_text())
    hangs = rundir.read_list(tmp_path / rundir.HANGS, rundir.Hang)
    assert [h.to_json() for h in hangs] == written and hangs[0].rank == 0 and "step 7" in hangs[0].evidence
    # The heartbeat file hang.py read, as the module reads it.
    beat = rundir.RankBeat.from_text((tmp_path / "ranks" / "rank0").read_text())
    assert beat == rundir.RankBeat(7, 4242, "node0") and beat.to_text() == "7 4242 node0\n"


def test_interruptions_read_what_spotwatch_records_and_append_keeps_its_shape(tmp_path):
    run = rundir.run_dir(tmp_path, "r")
    run.mkdir(parents=True)
    (tmp_path / rundir.RUNS / rundir.ACTIVE).write_text(str(run) + "\n")
    (run / rundir.PROGRESS).write_text(json.dumps({"step": 12}))
    notice = spotwatch.Notice("stop", "2025-01-01T00:02:00Z")
    spotwatch.handle(notice, tmp_path, "1", "i-0abc", now=time.time(), host="10.0.0.2")
    spotwatch.handle(notice, tmp_path, "x", None, now=time.time())
    path = run / rundir.INTERRUPTIONS
    written = json.loads(path.read_text())
    entries = rundir.read_list(path, rundir.Interruption)
    assert [e.to_json() for e in entries] == written
    assert (entries[0].node, entries[0].host, entries[0].step) == (1, "10.0.0.2", 12) and entries[1].node == "x"
    assert (run / rundir.STOP).read_text().startswith(rundir.URGENT_STOP_WORD + ":")
    # The module's append writes the same bytes spotwatch.record would.
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    for folder in (theirs, ours):
        folder.mkdir()
    for entry in entries:
        spotwatch.record(theirs, entry.to_json())
        rundir.append(ours / rundir.INTERRUPTIONS, entry, lock=ours / rundir.INTERRUPTIONS_LOCK)
    assert (ours / rundir.INTERRUPTIONS).read_text() == (theirs / rundir.INTERRUPTIONS).read_text()


def test_node_heartbeats_read_what_autostop_shares(tmp_path):
    autostop.share(tmp_path, "2", 123.5, ["run r: step moved"])
    path = clusterdir.node_json(tmp_path, clusterdir.HEARTBEAT_DIR, 2)
    beat = rundir.read_record(path, rundir.NodeHeartbeat)
    assert beat == rundir.NodeHeartbeat(time=123.5, busy=("run r: step moved",))
    assert beat.to_json() == json.loads(path.read_text())


@pytest.mark.parametrize("then_stop", [False, True])
def test_the_spec_reads_exactly_what_fab_train_writes(then_stop):
    environ = {"AWS_ENDPOINT_URL": "http://localhost:5000", "AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t"}
    local = inventory(nodes=3, gpus=2, source="local")
    local.extra["controller_ip"] = "10.213.0.1"
    request = launch.TrainRequest(then_stop=then_stop, max_restarts=2)
    written = launch.train_spec(local, request, "eth0", "/code/train", environ)
    run_spec = spec.RunSpec.from_json(json.loads(json.dumps(written.to_json())))
    assert run_spec == written and run_spec.hosts == ("10.42.0.5", "10.42.0.6", "10.42.0.7") and run_spec.slots == 2
    assert run_spec.limits.max_restarts == 2 and (run_spec.then_stop is not None) == then_stop
    if then_stop:
        assert run_spec.then_stop.env["AWS_ENDPOINT_URL"] == "http://10.213.0.1:5000"  # type: ignore[union-attr]


def test_a_missing_or_partly_written_file_reads_as_the_default(tmp_path):
    path = tmp_path / rundir.PROGRESS
    assert rundir.read_json(path, {}) == {} and rundir.read_record(path, rundir.Progress) is None
    path.write_text('{"step": 3, "max_st')  # a writer that was not atomic, cut short
    assert rundir.read_json(path, {}) == {} and rundir.read_record(path, rundir.Progress) is None
    path.write_text("")
    assert rundir.read_json(path) is None
    path.write_text('{"step": 3}')  # what the tests' fixtures and an old trainer leave
    assert rundir.read_record(path, rundir.Progress) == rundir.Progress(step=3)
    lst = tmp_path / rundir.HANGS
    lst.write_text(json.dumps([{"time": 1, "rank": 0, "evidence": "e"}, {"rank": 1}, "junk"]))
    assert rundir.read_list(lst, rundir.Hang) == (rundir.Hang(time=1.0, rank=0, evidence="e"),)
    lst.write_text("{}")
    assert rundir.read_list(lst, rundir.Hang) == ()


def test_writes_are_atomic_and_leave_no_temp_file_behind(tmp_path, monkeypatch):
    path = tmp_path / rundir.RUN_STATUS
    rundir.write_record(path, SAMPLES[0])
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        rundir.write_json(path, {"state": "finished"})
    assert synced and rundir.read_record(path, rundir.RunStatus) == SAMPLES[0]  # the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == [rundir.RUN_STATUS]


def test_the_protocol_table_lists_every_name_the_modules_define():
    table = protocol.protocol_table()
    names = {
        k: v for module in (rundir, clusterdir) for k, v in vars(module).items() if k.isupper() and isinstance(v, str)
    }
    names.pop("URGENT_STOP_WORD")  # a word in STOP, not a file
    names.pop("CHECKPOINT_GLOB")  # a pattern over CHECKPOINT's files
    names.pop("SNAPSHOT_GLOB")  # a pattern over SNAPSHOT's files
    assert len(names) > 40
    missing = [k for k, v in names.items() if v not in table]
    assert not missing, missing
    rows = table.splitlines()
    assert rows[0] == "| name | writer | readers | format |" and len(rows) == len(protocol.FILES) + 2
    for row in protocol.FILES:
        assert row.record is None or row.record in {r.__name__ for r in rundir.RECORDS}


# Words of the protocol's vocabularies that mean something else where these modules spell them.
OTHER_MEANINGS = {
    ("cluster_node/daemons/autostop/cloud.py", "running"): "an EC2 instance state",
    ("cluster_node/daemons/autostop/cloud.py", "stopping"): "an EC2 instance state",
    ("cluster_node/daemons/autostop/watchdog.py", "stopping"): "an EC2 instance state",
    ("cluster_node/supervisor/ec2state.py", "running"): "an EC2 instance state",
    ("cluster_node/programs/health.py", "unreachable"): "a node's health verdict (restarts.json's `dropped`)",
    ("cluster_node/programs/health.py", "failed"): "nvidia-smi's output",
    ("cluster_node/programs/node_status.py", "failed"): "a marker span's outcome word",
}


def _spelled(tree: ast.AST, words: set[str]) -> list[tuple[int, str]]:
    """String constants equal to one of `words`, but not as a key (`x["k"]`, `{"k": v}`, `.get("k")`) nor as
    an Enum member's value (the supervisor's State)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            skip.add(id(node.slice))
        elif isinstance(node, ast.Dict):
            skip.update(id(key) for key in node.keys if key is not None)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in ("get", "pop", "setdefault"):
                skip.add(id(node.args[0]))
        elif isinstance(node, ast.ClassDef) and any("Enum" in ast.unparse(base) for base in node.bases):
            skip.update(id(n) for n in ast.walk(node))
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in words and id(node) not in skip
    )


def test_no_module_on_the_nodes_spells_a_run_state_or_a_kind_as_a_bare_string():
    """rundir's enums (RunState, EndKind, ThenStopState) spell run-status.json's, restarts.json's and
    phases.jsonl's words once (27 literals under assets/ spelled them, issue 31)."""
    words = {v.value for enum in (rundir.RunState, rundir.EndKind, rundir.ThenStopState) for v in enum}
    assets = Path(rundir.__file__).parents[2]
    found = []
    for path in sorted(assets.rglob("*.py")):
        name = path.relative_to(assets).as_posix()
        if name == "cluster_node/protocol/rundir.py":
            continue
        spelled = _spelled(ast.parse(path.read_text()), words)
        found += [f"{name}:{line}: {word!r}" for line, word in spelled if (name, word) not in OTHER_MEANINGS]
    assert not found, "use rundir.RunState / EndKind / ThenStopState:\n" + "\n".join(found)


def test_the_guard_sees_a_state_compared_assigned_or_passed_but_not_a_key():
    tree = ast.parse(
        'if state != "running": kind = "spot"\nf(then_stop="sent")\nreturn why, "hang"\n'
        'x = d["failed"]; y = d.get("died"); z = {"forced": 1}\nclass S(str, Enum):\n    A = "budget"\n'
    )
    assert _spelled(tree, {"running", "spot", "sent", "hang", "failed", "died", "forced", "budget"}) == [
        (1, "running"),
        (1, "spot"),
        (2, "sent"),
        (3, "hang"),
    ]


def test_what_ended_the_trainer_is_read_from_ended_by_or_from_an_older_records_words():
    assert rundir.Progress(step=5, ended="max_steps", ended_by="stop").end == rundir.EndedBy.STOP  # the value decides
    older = {
        "max_steps": "steps",
        "stop requested (checkpoint now, no eval)": "stop",
        "target bleu 30.0 reached": "target",
    }
    for words, by in older.items():
        assert rundir.Summary.from_json({"recipe": "r", "steps": 5, "ended": words}).end == by
    assert rundir.Progress(step=5).end is None and rundir.Progress(step=5, ended_by="a later one").end is None
