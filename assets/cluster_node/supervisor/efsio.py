"""The EFS I/O a run bills on Elastic throughput, from CloudWatch: the bytes really read and written since
the run's start, not a rate measured before it.

AWS's contract (EFS User Guide, "CloudWatch metrics for Amazon EFS",
https://docs.aws.amazon.com/efs/latest/ug/efs-metrics.html): AWS/EFS DataReadIOBytes, DataWriteIOBytes,
MetadataReadIOBytes and MetadataWriteIOBytes, dimension FileSystemId, statistic Sum = the bytes of those
operations in the period. Elastic throughput bills data and metadata reads at the read price and writes at
the write price ("How Amazon EFS reports file system and object sizes",
https://docs.aws.amazon.com/efs/latest/ug/metered-sizes.html; https://aws.amazon.com/efs/pricing/).
CloudWatch publishes them a minute or two late, so the meter asks every QUERY_S, not at every poll, for
the minutes older than LAG_S (GetMetricStatistics' EndTime is exclusive, its StartTime rounded down to the
minute: https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/API_GetMetricStatistics.html).

boto3 is imported only when asked (the training image has it; the emulated cluster has no file system
to meter). Everything else: stdlib."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional

DATA = ("DataReadIOBytes", "DataWriteIOBytes")
METADATA = ("MetadataReadIOBytes", "MetadataWriteIOBytes")  # AWS re:Post's names (see docs/deploy-readiness.md)
METADATA_ONE = "MetadataIOBytes"  # the EFS metrics page's name: counted at the read price when the split is absent
QUERY_S = 180.0  # 4-5 GetMetricStatistics calls each time, 8-10 while a tail is out ($0.01 per 1,000)
LAG_S = 300.0  # asked to an end this old: CloudWatch has published EFS's 1-minute datapoints 1-2 min late
GRACE_S = 1.0  # how long the poll that asks waits for the answer; later polls never wait
MAX_DATAPOINTS = 1440  # GetMetricStatistics' limit per call
DAY = 86400.0
MARGIN_S = 3600.0  # our clock against CloudWatch's: a coarser unit an hour early is valid either side


def period_s(start: datetime, end: datetime, now: Optional[datetime] = None) -> int:
    """A period GetMetricStatistics accepts for start..end (API reference, GetMetricStatistics,
    https://docs.aws.amazon.com/AmazonCloudWatch/latest/APIReference/API_GetMetricStatistics.html): a StartTime
    under 15 days old is rounded down to the minute and takes multiples of 60 s; 15-63 days old, down to 5
    minutes and multiples of 300 s; older, down to the hour and multiples of 3600 s (another period returns no
    datapoints, no error); at most MAX_DATAPOINTS points counted from the rounded-down start."""
    age = ((now or datetime.now(timezone.utc)) - start).total_seconds()
    unit = 3600 if age >= 63 * DAY - MARGIN_S else 300 if age >= 15 * DAY - MARGIN_S else 60
    span = end.timestamp() - start.timestamp() // unit * unit
    return max(unit, math.ceil(span / MAX_DATAPOINTS / unit) * unit)


def io_gb(cloudwatch, file_system_id: str, start: datetime, end: datetime) -> tuple[float, float]:
    """GB (1e9 bytes) read and written through the file system between start and end, data and metadata.
    An unknown metric name returns empty Datapoints, not an error: when neither split metadata metric has
    any, MetadataIOBytes counts at the read price."""
    period = period_s(start, end)
    dimensions = [{"Name": "FileSystemId", "Value": file_system_id}]

    def total(metric: str) -> Optional[float]:
        points = cloudwatch.get_metric_statistics(
            Namespace="AWS/EFS",
            MetricName=metric,
            StartTime=start,
            EndTime=end,
            Period=period,
            Dimensions=dimensions,
            Statistics=["Sum"],
        )["Datapoints"]
        return sum(point["Sum"] for point in points) / 1e9 if points else None

    read, write = (total(metric) or 0.0 for metric in DATA)
    split = [total(metric) for metric in METADATA]
    if split == [None, None]:
        return read + (total(METADATA_ONE) or 0.0), write
    return read + (split[0] or 0.0), write + (split[1] or 0.0)


def client(region: str):
    """A CloudWatch client that gives up in seconds: one attempt, no retries (boto3 guide, "Retries":
    https://boto3.amazonaws.com/v1/documentation/api/latest/guide/retries.html: max_attempts counts retries
    after the first call, total_max_attempts all calls; the next question comes QUERY_S later anyway)."""
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=2, read_timeout=3, retries={"total_max_attempts": 1, "mode": "standard"})
    return boto3.client("cloudwatch", region_name=region, config=config)


def measure(file_system_id: str, region: str, start: float, end: float, client=client) -> tuple[float, float]:
    """io_gb between two epoch times. RuntimeError with one line when CloudWatch cannot answer, for any
    reason (no boto3, an empty region: ValueError, an endpoint that refuses or times out, an API error)."""
    utc = timezone.utc
    try:
        when = datetime.fromtimestamp(start, utc), datetime.fromtimestamp(end, utc)
        return io_gb(client(region), file_system_id, *when)
    except Exception as error:  # the meter falls back on the launch-time rate; the run goes on
        line = (str(error).splitlines() or [""])[0] or type(error).__name__
        raise RuntimeError(line) from None


def minute(epoch: float, up: bool = False) -> float:
    """`epoch` rounded down (up) to the minute: EFS's datapoints are minutes, each stamped with its start."""
    return -(-epoch // 60) * 60 if up else epoch // 60 * 60


@dataclass(frozen=True)
class Reading:
    read_gb: float
    write_gb: float
    at: float  # epoch s: CloudWatch's bytes are counted to here (an end older than LAG_S: all published)


class EfsIo:
    """The run's EFS I/O dollars: CloudWatch's bytes since `start` (and the carried tail, budget.io_tail) x the
    read and write prices, up to an end LAG_S old; the launch-time $/hour for the time after it, and for all
    of it without CloudWatch (no file system id, an API error). The question runs on a daemon thread: a
    CloudWatch that hangs holds the supervisor's loop GRACE_S at most."""

    def __init__(self, budget, start: float, measure=measure):
        self.budget, self.start, self.measure = budget, start, measure
        self.reading: Optional[Reading] = None
        self.asked: Optional[float] = None
        self.why = "" if budget.file_system_id else "no file system to meter"
        self._asking: Optional[threading.Thread] = None
        self._answer: tuple[Optional[Reading], str, Optional[tuple[float, float]]] = (None, "", None)
        self.tail = tuple(budget.io_tail[:2]) if len(budget.io_tail) == 2 else None
        self.tail_gb: Optional[tuple[float, float]] = None  # the tail's bytes, once all published
        # Its own bytes from the minute after the tail's last one: that minute's datapoint is the tail's.
        self.since = max(start, minute(self.tail[1], up=True)) if self.tail else start

    def update(self, now: float) -> None:
        """Ask CloudWatch when QUERY_S has passed since the last question, none is still out, and some minute
        it has published (older than LAG_S) is not counted yet."""
        self._collect()
        due = self.asked is None or now - self.asked >= QUERY_S
        first = self.tail[0] if self.tail else self.since
        if not self.budget.file_system_id or not due or minute(now - LAG_S) <= first or self._asking:
            return
        self.asked = now
        self._asking = threading.Thread(target=self._ask, args=(now,), name="efsio", daemon=True)
        self._asking.start()
        self.wait(GRACE_S)

    def _window(self, start: float, end: float) -> tuple[float, float]:
        """GB read and written in start..end; the start rounded down as GetMetricStatistics does."""
        if end <= start:
            return 0.0, 0.0
        return self.measure(self.budget.file_system_id, self.budget.region, minute(start), end)

    def _ask(self, now: float) -> None:
        end = minute(now - LAG_S)  # EndTime is exclusive: the minutes before it, all published
        tail = self.tail_gb
        try:
            if self.tail and tail is None:  # asked again until its end is published, then kept
                tail = self._window(self.tail[0], min(self.tail[1], end))
            own = self._window(self.since, end)
        except Exception as error:  # measure's RuntimeError, or a bug in a test's fake: never the loop's
            self._answer = (None, f"CloudWatch: {(str(error).splitlines() or [''])[0]}", None)
            return
        done = tail if self.tail and end >= self.tail[1] else None
        tail = tail or (0.0, 0.0)
        self._answer = (Reading(tail[0] + own[0], tail[1] + own[1], end), "", done)

    def _collect(self) -> None:
        """Take the answer of a question that ended (a failed one keeps the last reading): only in update()
        and wait(), so what one save() reads (spend, io_to, estimate) comes from one reading."""
        if self._asking is None or self._asking.is_alive():
            return
        self._asking = None
        reading, self.why, done = self._answer
        self.reading, self.tail_gb = reading or self.reading, self.tail_gb or done

    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait for the question out (tests; the poll that asks, GRACE_S)."""
        if self._asking is not None:
            self._asking.join(timeout)
        self._collect()

    @property
    def measured_usd(self) -> float:
        r, b = self.reading, self.budget
        return r.read_gb * b.io_read_usd_per_gb + r.write_gb * b.io_write_usd_per_gb if r else 0.0

    def unmeasured_hours(self, now: float) -> float:
        """Hours charged at the launch-time rate: the carried tail and this segment's time after the last
        reading's end (all of them without a reading); never the time between the segments."""
        done = self.reading.at if self.reading else -math.inf
        windows = [self.tail] if self.tail else []
        return sum(max(0.0, b - max(a, done)) for a, b in [*windows, (self.since, now)]) / 3600

    def counted_to(self, now: float) -> float:
        """budget.json's io_to: the epoch from which the I/O in usd(now) is the launch-time rate's estimate, for
        the next segment to ask CloudWatch for (Budget.io_tail); `now` without a file system to ask."""
        if not self.budget.file_system_id:
            return now
        if not self.reading:
            return self.tail[0] if self.tail else self.since
        past_tail = not self.tail or self.reading.at >= self.tail[1]
        return max(self.reading.at, self.since) if past_tail else self.reading.at

    def estimated_usd(self, now: float) -> float:
        """The launch-time rate's dollars after counted_to(now): a resumed segment measures them instead."""
        return self.unmeasured_hours(now) * self.budget.io_usd_per_hour if self.budget.file_system_id else 0.0

    def usd(self, now: float) -> float:
        return self.measured_usd + self.unmeasured_hours(now) * self.budget.io_usd_per_hour

    def describe(self, now: float) -> str:
        """How usd(now) was reached, for the budget line."""
        b, r, parts = self.budget, self.reading, []
        if r:
            at = datetime.fromtimestamp(r.at, timezone.utc).strftime("%H:%M:%S")
            parts.append(
                f"{r.read_gb:.3f} GB read x ${b.io_read_usd_per_gb:g} + {r.write_gb:.3f} GB written x "
                f"${b.io_write_usd_per_gb:g} (CloudWatch, the run's own I/O to {at} UTC)"
            )
        hours, why = self.unmeasured_hours(now), self.why or f"CloudWatch publishes {LAG_S / 60:g} min late"
        if hours or self.why:
            parts.append(f"{hours:.4f} h x ${b.io_usd_per_hour:g}/h (the launch-time rate: {why})")
        return " + ".join(parts)
