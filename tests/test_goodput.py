"""The goodput account (cluster_node/supervisor/goodput.py) on hand-made phase marks, and the marks' file
(cluster_node/protocol/phases.py): torn lines skipped, concurrent appends whole."""

from __future__ import annotations

import multiprocessing

import pytest

from cluster_node.protocol import phases
from cluster_node.protocol.phases import Phase
from cluster_node.supervisor import goodput


def _marks() -> list[Phase]:
    """A 100 s run: start-up 10 s, steps 0..40 at 1 s/step with a checkpoint at 20 (2 s) and an eval at 10
    (3 s); a node dies after step 30; restart at step 20; steps 20..40 again, end at 92; done at 100."""
    m = [Phase(event="run", time=0.0), Phase(event="launch", time=1.0), Phase(event="process", time=3.0)]
    m += [Phase(event="rendezvous", time=4.0), Phase(event="ready", time=9.0, step=0)]
    m += [Phase(event="first_step", time=10.0, step=1), Phase(event="steps", time=19.0, step=10)]
    m += [Phase(event="eval", time=19.0, end=22.0, step=10), Phase(event="steps", time=32.0, step=20)]
    m += [Phase(event="checkpoint", time=32.0, end=34.0, step=20), Phase(event="steps", time=44.0, step=30)]
    m += [Phase(event="detect", time=50.0, kind="died", step=30, end=44.0), Phase(event="decide", time=53.0, step=20)]
    m += [Phase(event="launch", time=53.5), Phase(event="process", time=55.0), Phase(event="rendezvous", time=56.0)]
    m += [Phase(event="ready", time=60.0, step=20), Phase(event="first_step", time=61.0, step=21)]
    # a stall: steps 30..40 take 22 s instead of 10
    m += [Phase(event="steps", time=70.0, step=30), Phase(event="steps", time=92.0, step=40)]
    m += [Phase(event="end", time=92.0, step=40), Phase(event="done", time=100.0)]
    return m


def test_every_second_of_a_restarted_run_is_accounted_once_and_the_lost_steps_are_those_after_the_checkpoint():
    acc = goodput.account(_marks())
    assert acc is not None and acc.wall_s == 100.0 and not acc.running
    assert sum(acc.phases.values()) == pytest.approx(100.0) and acc.phases["unaccounted"] == 0
    assert acc.phases["eval"] == 3 and acc.phases["checkpoint"] == 2
    assert acc.group("startup") == 10.0  # run 0 -> first step 10
    assert acc.phases["recomputed"] == 10.0  # checkpoint end 34 -> last beat 44
    [incident] = acc.incidents
    assert (incident.kind, incident.steps_lost, incident.lost_s) == ("died", 10, 10.0)
    assert (incident.detect_s, incident.decide_s, incident.relaunch_s, incident.first_step_s) == (6, 3, 7, 1)
    assert acc.phases["stall"] == pytest.approx(22 - 10 * 1.0)  # median 1 s/step: the excess
    assert acc.phases["shutdown"] == 8.0
    # productive: 10..19, 22..32 (34..44 is recomputed), 61..80 (80..92 stalled)
    assert acc.phases["productive"] == pytest.approx(9 + 10 + 19)
    assert acc.goodput == pytest.approx(0.38)
    assert acc.segments[0] == ("startup.launch", 0.0, 3.0)
    text = "\n".join(goodput.lines(acc))
    assert "goodput 38%" in text and "restart 1 (died" in text and "10 steps lost" in text


def test_the_warm_up_after_a_start_and_after_a_restart_is_its_own_cause():
    """Issue 29: a GPU step warms up (kernel plans, caches) after every start: steps 1..10 at 3 s, then 1 s;
    after the restart 21..30 at 2 s. The excess over the median step is `warmup`, the rest productive."""
    m = [Phase(event="run", time=0.0), Phase(event="launch", time=1.0), Phase(event="ready", time=9.0, step=0)]
    m += [Phase(event="first_step", time=10.0, step=1), Phase(event="steps", time=37.0, step=10)]
    m += [Phase(event="steps", time=47.0, step=20), Phase(event="checkpoint", time=47.0, end=48.0, step=20)]
    m += [Phase(event="steps", time=58.0, step=30), Phase(event="detect", time=60.0, kind="died", step=30, end=58.0)]
    m += [Phase(event="decide", time=61.0, step=20), Phase(event="launch", time=61.5), Phase(event="ready", time=65.0)]
    m += [Phase(event="first_step", time=66.0, step=21), Phase(event="steps", time=84.0, step=30)]
    m += [
        Phase(event="steps", time=94.0, step=40),
        Phase(event="end", time=94.0, step=40),
        Phase(event="done", time=95.0),
    ]
    acc = goodput.account(m)
    assert acc is not None and sum(acc.phases.values()) == pytest.approx(95.0)
    # median 1 s/step: (27 - 9) s after the start, (18 - 9) s after the restart
    assert acc.phases["warmup"] == pytest.approx(18 + 9) and acc.group("warmup") == acc.phases["warmup"]
    assert goodput.as_json(acc)["by_cause_s"]["warmup"] == pytest.approx(27)
    assert any(line.startswith("  warmup: 27.0 s (28%)") for line in goodput.lines(acc))
    # the batch shapes run once before the first step (a GPU's default): warm-up too, out of start-up
    plain, warmed = goodput.account(_marks()), goodput.account([*_marks(), Phase("warm_shapes", 5.0, end=8.0, step=0)])
    assert plain is not None and warmed is not None and plain.phases["startup.data"] == 5.0  # rendezvous 4 -> ready 9
    assert (warmed.phases["startup.data"], warmed.phases["warmup"] - plain.phases["warmup"]) == (2.0, 3.0)


def test_the_shapes_warmed_after_a_restart_are_warm_up_in_the_account_and_the_incident_alike():
    """The relaunch (decide 53 -> ready 60) holds 2 s of batch shapes run once (57..59): the incident's
    relaunch and the account's restart.relaunch both leave them to warm-up."""
    plain = goodput.account(_marks())
    warmed = goodput.account([*_marks(), Phase("warm_shapes", 57.0, end=59.0, step=20)])
    assert plain is not None and warmed is not None and plain.incidents[0].relaunch_s == 7
    assert warmed.incidents[0].relaunch_s == 5 == warmed.phases["restart.relaunch"]
    assert warmed.phases["warmup"] - plain.phases["warmup"] == 2.0


def test_a_resumed_run_is_accounted_over_every_segment_and_not_the_time_between():
    """A run stopped and resumed by a later `fab train` (the new-user walk: 62 s, then 72 s; the account
    said 86% of 62 s). The second segment starts 1,000 s later: that idle time is nobody's wall-clock."""
    second = [
        Phase(
            event=p.event, time=p.time + 1100.0, step=p.step, end=None if p.end is None else p.end + 1100.0, kind=p.kind
        )
        for p in _marks()
    ]
    acc = goodput.account(_marks() + second)
    one = goodput.account(_marks())
    assert acc.wall_s == pytest.approx(200.0) and sum(acc.phases.values()) == pytest.approx(200.0)
    assert acc.phases["productive"] == pytest.approx(2 * one.phases["productive"])
    assert acc.goodput == pytest.approx(one.goodput)
    assert [i.at_s for i in acc.incidents] == [one.incidents[0].at_s, one.incidents[0].at_s + 100.0]
    assert acc.segments[len(one.segments)][1] == pytest.approx(100.0)  # the second starts where the first ended
    assert acc.steps_kept == 40 and not acc.running


def test_a_node_lost_right_after_a_checkpoint_loses_no_step_and_no_negative_time():
    """The kill lands while the checkpoint of the last step is written (a CI run's drill): the checkpoint
    ends after the last beat. Before: "0 steps lost (-0.1 s to recompute)"."""
    m = [p for p in _marks() if p.time < 44.0 or p.event in ("ready", "first_step", "end", "done", "launch")]
    m = [p for p in m if not (p.event == "steps" and p.step == 30)]
    m = [p for p in m if p.time < 50.0 or p.event not in ("detect", "decide")]
    m += [Phase(event="checkpoint", time=32.0, end=32.2, step=20)]  # written after the step-20 beat at 32
    m += [Phase(event="detect", time=35.0, kind="died", step=20, end=32.0), Phase(event="decide", time=36.0, step=20)]
    acc = goodput.account(sorted(m, key=lambda p: p.time))
    [incident] = acc.incidents
    assert (incident.steps_lost, incident.lost_s) == (0, 0.0)


def test_a_running_run_is_accounted_up_to_now_and_a_run_without_marks_says_so():
    acc = goodput.account(_marks()[:8], now=25.0)
    assert acc is not None and acc.running and acc.wall_s == 25.0 and goodput.short(acc).endswith("*")
    assert sum(acc.phases.values()) == pytest.approx(25.0)
    assert goodput.account([]) is None and "no phases.jsonl" in goodput.lines(None)[0]


def _append(run, n):
    for i in range(n):
        phases.mark(run, "steps", float(i), step=i)


def test_marks_from_two_processes_stay_whole_and_a_torn_line_is_skipped(tmp_path):
    workers = [multiprocessing.Process(target=_append, args=(tmp_path, 300)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    with open(tmp_path / "phases.jsonl", "a") as handle:
        handle.write('{"event": "steps", "ti')
    assert len(phases.read(tmp_path)) == 600
    phases.mark(tmp_path / "missing", "run")  # no directory: swallowed, nothing raised


def test_the_supervisor_marks_the_run_each_launch_the_detection_the_decision_and_the_end(tmp_path):
    from test_supervisor import HEALTHY, NOW, Observation, Script, _supervisor

    sup, _, nodes = _supervisor(tmp_path, [None, 0], Script(Observation(NOW, unreachable="h2")), restarts=1)
    (tmp_path / "train.log").write_text("run ended at step 40: max_steps\n")
    (tmp_path / "summary.json").write_text('{"recipe": "transformer-tiny", "steps": 40}')
    nodes.probe_all = lambda: (tmp_path / "probes").mkdir() or (tmp_path / "probes" / "h1").write_text(HEALTHY)
    assert sup.run_all() == 0
    marks = phases.read(tmp_path)
    assert [m.event for m in marks] == ["run", "launch", "detect", "decide", "launch", "done"]
    assert marks[2].kind == "unreachable" and marks[3].step == 30 and marks[3].kind == "unreachable"
    assert '"goodput": {' in (tmp_path / "summary.json").read_text()  # finish() recorded the account


def test_the_account_goes_into_summary_json_at_the_end_and_never_makes_one_up(tmp_path):
    """§3: goodput in summary.json. The supervisor's finish records it into the trainer's summary (its
    other keys kept); a run without a summary (it failed before its end) gets none written."""
    import json

    for mark in _marks():
        phases.mark(
            tmp_path, mark.event, mark.time, **{k: v for k, v in mark.to_json().items() if k not in ("event", "time")}
        )
    goodput.record(tmp_path)
    assert not (tmp_path / "summary.json").exists()
    (tmp_path / "summary.json").write_text(json.dumps({"recipe": "transformer-tiny", "steps": 40}))
    goodput.record(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["recipe"] == "transformer-tiny" and summary["goodput"]["goodput"] == 0.38
    assert summary["goodput"]["by_cause_s"]["restart"] == 6 + 3 + 7 + 1 and summary["goodput"]["wall_s"] == 100
    [restart] = summary["goodput"]["restarts"]
    assert restart["kind"] == "died" and restart["steps_lost"] == 10


def test_the_timeline_png_and_the_runs_column(tmp_path):
    from clusterops.predict import plots
    from clusterops.run import analysis

    acc = goodput.account(_marks())
    path = plots.goodput_timeline(acc, tmp_path / "goodput.png", "r")
    assert path.read_bytes()[:4] == b"\x89PNG"
    from runfiles import run_files

    run = run_files("r", phases=[m.to_json() for m in _marks()])
    assert analysis.run_row(run, None)["goodput"] == "38%"
    assert analysis.run_row(run_files("r"), None)["goodput"] == ""
