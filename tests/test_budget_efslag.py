"""The `--budget-usd` meter's EFS I/O across a resume (issue 22 part 2, a fresh read): CloudWatch publishes
EFS metrics a minute or two late (1-minute periods, https://docs.aws.amazon.com/efs/latest/ug/efs-metrics.html),
so a reading that claims to reach the time it was asked misses the minutes before it, and the resumed
segment, asking only from there, never meters them. Against the moto server with a simulated publishing
delay: each minute's datapoint is put LAG s after that minute ends."""

from __future__ import annotations

import json
import threading
import time

import pytest
from test_budget_efsio import LAUNCH_RATE, WRITE, _budget, _put

from cluster_node.protocol import rundir
from cluster_node.supervisor import efsio
from cluster_node.supervisor.budget import Meter, Spend
from clusterops.run import budget as budgets
from clusterops.run.resume import Saved

LAG = 120.0  # CloudWatch's publishing delay in the simulation


class Efs:
    """A file system the run writes 1 GB a minute to while a segment runs."""

    def __init__(self, fs: str):
        self.fs, self.busy, self.put = fs, set[int](), set[int]()

    def run(self, begin: float, end: float) -> None:
        self.busy |= set(range(int(begin // 60 * 60), int(end), 60))  # every minute the segment touches

    def publish(self, now: float) -> None:
        for minute in sorted(self.busy - self.put):
            if minute + 60 + LAG <= now:
                _put(minute, self.fs, DataWriteIOBytes=1.0)
                self.put.add(minute)

    def gb_before(self, when: float) -> int:
        return len([minute for minute in self.busy if minute < when])


def _segment(efs: Efs, run, budget, start: float, end: float) -> dict:
    """The supervisor's meter over one segment, a poll a minute (its final save at `end`)."""
    meter, now = Meter(budget, start), start
    while now < end:
        now = min(end, now + 60.0)
        efs.publish(now)
        meter.save(run, now)
        meter.efs.wait()
    return json.loads((run / rundir.BUDGET).read_text())


def _resumed(saved: dict, fs: str):
    before = Saved(config={}, spec=None, budget=Spend.from_json(saved), step=None)
    return _budget(
        file_system_id=fs, usd_per_node_hour=0.0, spent=budgets.spent_before(before), io_tail=budgets.io_tail(before)
    )


@pytest.mark.parametrize("gap_s", [1800.0, 30.0])  # a resume 30 min later; one within CloudWatch's lag
def test_two_segments_with_a_resume_between_count_every_byte_once(tmp_path, aws_env, gap_s):
    fs = f"fs-0e1a9{int(gap_s):012d}"  # its own: the moto server outlives each test
    efs, s1 = Efs(fs), time.time() // 60 * 60 - 4 * 3600 + 17  # past the minute, as a supervisor starts
    e1 = s1 + 3600.0
    s2 = e1 + gap_s
    e2 = s2 + 1800.0
    efs.run(s1, e1)
    efs.run(s2, e2)
    first = _segment(efs, tmp_path, _budget(file_system_id=fs, usd_per_node_hour=0.0), s1, e1)
    second = _segment(efs, tmp_path, _resumed(first, fs), s2, e2)
    measured = budgets.spent_before(Saved(config={}, spec=None, budget=Spend.from_json(second), step=None))
    print(
        f"gap {gap_s:.0f} s: {measured / WRITE:.1f} GB metered before io_to, {efs.gb_before(second['io_to'])} written"
    )
    assert second["io_to"] > s2 and e2 - second["io_to"] <= efsio.LAG_S + efsio.QUERY_S + 60
    assert measured == pytest.approx(efs.gb_before(second["io_to"]) * WRITE)  # was 2-3 GB short: the lag's
    estimate = (e2 - second["io_to"]) / 3600 * LAUNCH_RATE  # the rest: the launch-time rate, carried
    assert second["spent"] == pytest.approx(measured + estimate)


def test_a_tail_cloudwatch_never_answers_for_is_charged_at_the_launch_rate_and_carried_again():
    def down(*_):
        raise RuntimeError("could not connect to the endpoint URL")

    start, now = 1_002_000.0, 1_003_200.0
    io = efsio.EfsIo(_budget(io_tail=(1_000_020.0, 1_000_600.0)), start, measure=down)
    io.update(now)
    io.wait()
    assert io.usd(now) == pytest.approx(LAUNCH_RATE * (580 + 1200) / 3600)  # was 1200 s: the tail free
    assert io.counted_to(now) == 1_000_020.0  # was `now`: the next segment asks CloudWatch for all of it


def test_an_answer_that_lands_mid_save_is_taken_at_the_next_update_not_between_two_reads():
    """save() reads the spend, io_to and the estimate: an answer taken between two of those reads mixed an
    old and a new reading (a fresh read's finding; before, counted_to(), usd() and describe() each took it)."""
    release = threading.Event()

    def slow(*_):  # CloudWatch answering after the poll's grace
        release.wait(10)
        return 1.0, 1.0

    start, now = 1_000_000.0, 1_001_200.0
    io = efsio.EfsIo(_budget(), start, measure=slow)
    io.update(now)  # asks; waits GRACE_S, no answer yet
    before = io.counted_to(now), io.usd(now)
    release.set()
    io._asking.join(5)  # the answer is in, not yet taken
    assert (io.counted_to(now), io.usd(now)) == before and io.reading is None
    io.update(now + 1)  # the next poll takes it
    assert io.reading is not None and io.counted_to(now + 1) == io.reading.at
