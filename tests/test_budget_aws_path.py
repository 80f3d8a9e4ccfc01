"""A fresh read of the `--budget-usd` meter as a first real AWS use would run it (issue 22 part 2): a crash
still stops the nodes, the meter's own failures never end a healthy run, a CloudWatch that hangs does not
hold up the supervisor's loop, the period obeys GetMetricStatistics' rules, metadata I/O is counted under
either metric shape EFS publishes."""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from conftest import environment
from test_budget import _supervisor
from test_budget_efsio import FS, READ, WRITE, _budget, _put
from test_supervisor import NOW

from cluster_node.protocol import rundir
from cluster_node.supervisor import efsio
from cluster_node.supervisor.budget import Meter, Spend
from cluster_node.supervisor.observe import Observation

UTC = timezone.utc
DAY = 86400


def test_a_supervisor_crash_still_stops_the_nodes_a_budget_implies(tmp_path):
    """A budget implies --then-stop: "the nodes stop when the run ends, however it ends" (also a crash)."""
    sup, mpirun = _supervisor(tmp_path, [None], lambda: NOW)
    sup.spec = rundir_spec_with_then_stop(sup.spec)
    sup.launch()
    sup.crashed(RuntimeError("a bug"))
    calls = [c for c in sup.nodes.calls if c[0] == "then_stop"]
    assert len(calls) == 1, "crashed() left the cluster billing"
    before = json.loads(calls[0][1])  # the status first: the stop may end this process
    assert (before["state"], before["then_stop"]) == ("failed", "stopping")
    after = json.loads((tmp_path / "run-status.json").read_text())  # a follower waits for this outcome
    assert (after["state"], after["then_stop"]) == ("failed", "sent")


def test_a_crash_whose_then_stop_fails_still_ends_quietly(tmp_path):
    sup, _ = _supervisor(tmp_path, [None], lambda: NOW)
    sup.spec = rundir_spec_with_then_stop(sup.spec)

    def broken(log):
        raise OSError("no route to the EC2 endpoint")

    sup.nodes.then_stop = broken
    sup.launch()
    sup.crashed(RuntimeError("a bug"))  # raises nothing: main() re-raises the original error
    assert json.loads((tmp_path / "run-status.json").read_text())["state"] == "failed"


def test_a_crash_from_a_full_data_volume_still_stops_the_nodes(tmp_path, monkeypatch):
    """The crash's own cause may be /data (ENOSPC, ESTALE): its status write fails too; the stop must not."""
    sup, _ = _supervisor(tmp_path, [None], lambda: NOW)
    sup.spec = rundir_spec_with_then_stop(sup.spec)
    sup.launch()
    sup.status("running", None, "")  # as run_all writes it first

    def full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rundir, "write_bytes", full)
    sup.crashed(OSError(28, "No space left on device"))  # raises nothing: main() re-raises the original
    assert [c[0] for c in sup.nodes.calls].count("then_stop") == 1, "a full /data left the cluster billing"


def test_then_stop_runs_even_when_the_runs_log_cannot_be_opened(tmp_path):
    """The failure that ended the run may be /data's: the stop request must not depend on train.log."""
    import dataclasses

    from cluster_node.protocol import spec
    from cluster_node.supervisor import nodes

    marker = tmp_path / "stopped"
    sup, _ = _supervisor(tmp_path, [None], lambda: NOW)
    run_spec = dataclasses.replace(sup.spec, then_stop=spec.ThenStop(("sh", "-c", f"echo stop > {marker}")))
    assert nodes.Nodes(tmp_path, run_spec).then_stop(tmp_path / "gone" / "train.log")
    assert marker.read_text() == "stop\n"


def rundir_spec_with_then_stop(run_spec):
    import dataclasses

    from cluster_node.protocol import spec

    return dataclasses.replace(run_spec, then_stop=spec.ThenStop(("stop",)))


def test_an_unwritable_budget_json_does_not_kill_a_healthy_run(tmp_path, monkeypatch):
    """EFS may refuse a write for a moment (ENOSPC, a stale handle): the meter keeps counting in memory."""
    now = [NOW]
    sup, _ = _supervisor(tmp_path, [None, None], lambda: now[0])
    sup.launch()
    real = rundir.write_record

    def failing(path, record):
        if path.name == rundir.BUDGET:
            raise OSError(28, "No space left on device")
        return real(path, record)

    monkeypatch.setattr(rundir, "write_record", failing)
    for t in (1, 2):  # two polls: one log line, not one per poll
        now[0] = NOW + t
        sup.apply(sup.decide(Observation(NOW + t, first_step=True)))
    log = (tmp_path / "train.log").read_text()
    assert log.count("could not save budget.json") == 1 and "No space left on device" in log
    assert sup.meter.node_hours == pytest.approx(2 * 2 / 3600)  # still metered
    monkeypatch.setattr(rundir, "write_record", real)
    now[0] = NOW + 3
    sup.apply(sup.decide(Observation(NOW + 3, first_step=True)))
    assert json.loads((tmp_path / rundir.BUDGET).read_text())["time"] == NOW + 3  # saved again once it can


@pytest.mark.parametrize("region", [""])
def test_any_cloudwatch_failure_falls_back_to_the_launch_rate_saying_why(region, moto_env):
    """boto3.client(region_name="") raises ValueError, not a BotoCoreError: it ended the run."""
    with environment({**moto_env, "AWS_DEFAULT_REGION": ""}):
        io = efsio.EfsIo(_budget(region=region), 1_000.0)
        io.update(2_000.0)
        io.wait()
    assert io.why.startswith("CloudWatch: ") and "\n" not in io.why


def test_measure_turns_any_exception_into_one_line():
    def boom(*_):
        raise ModuleNotFoundError("No module named 'botocore'")

    with pytest.raises(RuntimeError, match="No module named 'botocore'"):
        efsio.measure(FS, "us-east-1", 0.0, 60.0, client=boom)


def _silent_server() -> tuple[socket.socket, list[socket.socket]]:
    """A socket that accepts and never answers: a black-holed CloudWatch endpoint."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return server, held


def test_a_hanging_cloudwatch_costs_the_supervisors_loop_under_a_few_seconds(moto_env):
    """Was 4 calls x 3 attempts (max_attempts 2 = 2 retries) x read_timeout 10 s: a Spot notice on the head
    node (two minutes) waited behind it."""
    server, held = _silent_server()
    endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        with environment({**moto_env, "AWS_ENDPOINT_URL": endpoint}):
            meter = Meter(_budget(), 1_000_000.0)
            began = time.monotonic()
            meter.add(nodes=1, now=1_000_000.0 + 600)
            meter.add(nodes=1, now=1_000_000.0 + 605)  # the next poll: still not waiting on CloudWatch
            spent = time.monotonic() - began
            meter.efs.wait()
    finally:
        server.close()
        for conn in held:
            conn.close()
    print(f"loop held {spent:.2f} s by a silent CloudWatch endpoint")
    assert spent < 3.0
    assert "CloudWatch: " in meter.line(step=1)  # the launch-time rate, saying why


# GetMetricStatistics (https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/API_GetMetricStatistics.html):
# at most 1,440 points; a StartTime 15-63 days old needs a period multiple of 300 s, older 3600 s (else no
# datapoints); a StartTime under 15 days old is rounded down to the minute.
NOW_DT = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)


def _points(start: datetime, end: datetime, period: int, unit: int) -> int:
    floor = start.timestamp() // unit * unit
    return -int(-(end.timestamp() - floor) // period)


@pytest.mark.parametrize(
    "age_days, unit",
    [(0.01, 60), (1, 60), (14.99, 60), (15.01, 300), (62.9, 300), (63.1, 3600), (200, 3600)],
)
@pytest.mark.parametrize("offset_s", [0, 1, 30, 59])
def test_the_period_obeys_get_metric_statistics_rules(age_days, unit, offset_s):
    start = NOW_DT - timedelta(days=age_days) + timedelta(seconds=offset_s)
    for end in (NOW_DT, start + timedelta(days=1), start + timedelta(days=1, seconds=1)):
        if end <= start:
            continue
        period = efsio.period_s(start, end, now=NOW_DT)
        assert period % unit == 0, (age_days, period)
        assert _points(start, end, period, unit) <= efsio.MAX_DATAPOINTS


def test_an_exact_day_at_a_second_past_the_minute_is_not_1441_points():
    start = NOW_DT - timedelta(days=1) + timedelta(seconds=30)  # rounded down to 11:00:00 the day before
    period = efsio.period_s(start, start + timedelta(days=1), now=NOW_DT)
    assert _points(start, start + timedelta(days=1), period, 60) <= 1440 and period == 120


def test_metadata_as_one_metric_is_counted_at_the_read_price(aws_env):
    """The EFS metrics page lists MetadataIOBytes; an unknown metric returns empty Datapoints, no error."""
    fs = "fs-0e7adata10b17e500"  # its own: the moto server outlives each test
    start = time.time() - 600
    _put(start + 60, fs, DataReadIOBytes=3, DataWriteIOBytes=1, MetadataIOBytes=2)
    meter = Meter(_budget(file_system_id=fs), start)
    meter.add(nodes=1, now=start + 600)
    meter.efs.wait()
    assert meter.efs.measured_usd == pytest.approx(5 * READ + 1 * WRITE)  # was 3 x READ + 1 x WRITE: metadata $0


def test_split_metadata_metrics_are_not_counted_twice(aws_env):
    fs = "fs-0e7adata5b117000"
    start = time.time() - 600
    _put(start + 60, fs, DataReadIOBytes=3, MetadataReadIOBytes=1, MetadataWriteIOBytes=2, MetadataIOBytes=3)
    meter = Meter(_budget(file_system_id=fs), start)
    meter.add(nodes=1, now=start + 600)
    meter.efs.wait()
    assert meter.efs.measured_usd == pytest.approx(4 * READ + 2 * WRITE)


def test_a_spot_notice_under_then_stop_says_fab_start_not_that_ec2_restarts_the_node(tmp_path):
    """--then-stop (a budget implies it) stops every node with StopInstances after the notice: EC2 restarts an
    instance it interrupted, never one a user stopped, so "once EC2 starts it again" would wait for ever."""
    from test_supervisor import Script
    from test_supervisor import _status as status_of
    from test_supervisor import _supervisor as supervisor_of

    action = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW + 120))
    notice = rundir.Interruption(node=0, host="h1", action="stop", action_time=action, noticed="x")
    sup, _, nodes = supervisor_of(tmp_path, [None, 0], Script(notice=notice), restarts=2, then_stop=True)
    sup.run_all()
    reason = status_of(tmp_path)["reason"]
    assert "resumable, `fab start`, then `fab inventory`, then fab train --run" in reason, reason
    assert "once EC2 starts it again" not in reason and [c for c in nodes.calls if c[0] == "then_stop"]


def test_the_efs_io_cloudwatch_had_not_published_when_a_segment_ended_is_metered_by_the_next(tmp_path, aws_env):
    """CloudWatch lags: the last reading of a segment stops short of its end. budget.json keeps where the
    reading stopped and the segment's end; the resumed segment asks CloudWatch for that tail once."""
    import dataclasses

    from clusterops.run import budget as budgets
    from clusterops.run.resume import Saved

    fs = "fs-0e7ad0ta11000000"
    start = time.time() - 1200
    _put(start + 60, fs, DataReadIOBytes=10)
    first = Meter(_budget(file_system_id=fs), start)
    first.save(tmp_path, start + 600)  # CloudWatch read up to LAG_S before it, rounded down to the minute
    first.save(tmp_path, start + 660)  # the segment ends a minute later, before the next question
    _put(start + 630, fs, DataReadIOBytes=5)  # I/O of that last minute, published after the end
    saved = json.loads((tmp_path / rundir.BUDGET).read_text())
    assert first.efs.measured_usd == pytest.approx(10 * READ)

    window = budgets.io_tail(Saved(config={}, spec=None, budget=Spend.from_json(saved), step=None))
    assert window == (efsio.minute(start + 600 - efsio.LAG_S), start + 660)
    carried = _budget(file_system_id=fs, spent=saved["spent"], io_tail=window)
    second = Meter(carried, start + 900)
    second.add(nodes=1, now=start + 1000)
    second.efs.wait()
    assert second.efs.measured_usd == pytest.approx(5 * READ)  # was $0: the tail was in no segment
    assert dataclasses.asdict(carried)["io_tail"] == window


def test_the_carried_io_window_survives_spec_json(tmp_path):
    from cluster_node.protocol import spec as specs

    sup, _ = _supervisor(tmp_path, [None], lambda: NOW)
    carried = _budget(io_tail=(NOW - 60.0, NOW))
    specs.write(tmp_path, rundir_spec_with_budget(sup.spec, carried))
    assert specs.read(tmp_path).budget == carried  # a tuple again, not JSON's list


def rundir_spec_with_budget(run_spec, budget):
    import dataclasses

    return dataclasses.replace(run_spec, budget=budget)
