"""The EFS I/O a run bills on Elastic throughput, from CloudWatch: the bytes really read and written since
the run's start, not a rate measured before it.

AWS's contract (EFS User Guide, "CloudWatch metrics for Amazon EFS",
https://docs.aws.amazon.com/efs/latest/ug/efs-metrics.html): AWS/EFS DataReadIOBytes, DataWriteIOBytes,
MetadataReadIOBytes and MetadataWriteIOBytes, dimension FileSystemId, statistic Sum = the bytes of those
operations in the period. Elastic throughput bills data and metadata reads at the read price and writes at
the write price ("How Amazon EFS reports file system and object sizes",
https://docs.aws.amazon.com/efs/latest/ug/metered-sizes.html; https://aws.amazon.com/efs/pricing/).
CloudWatch publishes them a minute or two late, so the meter asks every QUERY_S, not at every poll.

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
QUERY_S = 180.0  # CloudWatch lags 1-2 min; 4-5 GetMetricStatistics calls each time ($0.01 per 1,000)
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


@dataclass(frozen=True)
class Reading:
    read_gb: float
    write_gb: float
    at: float  # the end of the window (epoch seconds)


class EfsIo:
    """The run's EFS I/O dollars: CloudWatch's bytes since `start` x the read and write prices; without
    CloudWatch (no file system id, an API error) the launch-time $/hour for the time not measured. The
    question runs on a daemon thread: a CloudWatch that hangs holds the supervisor's loop GRACE_S at most."""

    def __init__(self, budget, start: float, measure=measure):
        self.budget, self.start, self.measure = budget, start, measure
        self.reading: Optional[Reading] = None
        self.asked: Optional[float] = None
        self.why = "" if budget.file_system_id else "no file system to meter"
        self._asking: Optional[threading.Thread] = None
        self._answer: tuple[Optional[Reading], str] = (None, "")
        self.tail: Optional[tuple[float, float]] = None  # GB of budget.io_tail, once CloudWatch answered

    def update(self, now: float) -> None:
        """Ask CloudWatch when QUERY_S has passed since the last question and none is still out."""
        self._collect()
        due = self.asked is None or now - self.asked >= QUERY_S
        if not self.budget.file_system_id or not due or now <= self.start or self._asking:
            return
        self.asked = now
        self._asking = threading.Thread(target=self._ask, args=(now,), name="efsio", daemon=True)
        self._asking.start()
        self.wait(GRACE_S)

    def _ask(self, now: float) -> None:
        fs, region = self.budget.file_system_id, self.budget.region
        try:
            read, write = self.measure(fs, region, self.start, now)
            if self.tail is None and len(self.budget.io_tail) == 2:  # asked once: the window is closed
                self.tail = self.measure(fs, region, *self.budget.io_tail)
            read, write = read + (self.tail or (0.0, 0.0))[0], write + (self.tail or (0.0, 0.0))[1]
        except Exception as error:  # measure's RuntimeError, or a bug in a test's fake: never the loop's
            self._answer = (None, f"CloudWatch: {(str(error).splitlines() or [''])[0]}")
            return
        self._answer = (Reading(read, write, now), "")

    def _collect(self) -> None:
        """Take the answer of a question that ended (a failed one keeps the last reading)."""
        if self._asking is None or self._asking.is_alive():
            return
        self._asking = None
        reading, self.why = self._answer
        self.reading = reading or self.reading

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
        """Hours charged at the launch-time rate: none while CloudWatch answers."""
        if not self.why:
            return 0.0
        return max(0.0, now - (self.reading.at if self.reading else self.start)) / 3600

    def counted_to(self, now: float) -> float:
        """The epoch up to which usd(now) counts the I/O: the launch-time rate runs to `now`, CloudWatch's
        bytes to its last reading (the next segment asks for the rest, Budget.io_tail)."""
        self._collect()
        if self.why:
            return now
        return self.reading.at if self.reading else min([self.start, *self.budget.io_tail[:1]])

    def usd(self, now: float) -> float:
        self._collect()
        return self.measured_usd + self.unmeasured_hours(now) * self.budget.io_usd_per_hour

    def describe(self, now: float) -> str:
        """How usd(now) was reached, for the budget line."""
        self._collect()
        b, r, parts = self.budget, self.reading, []
        if r:
            at = datetime.fromtimestamp(r.at, timezone.utc).strftime("%H:%M:%S")
            parts.append(
                f"{r.read_gb:.3f} GB read x ${b.io_read_usd_per_gb:g} + {r.write_gb:.3f} GB written x "
                f"${b.io_write_usd_per_gb:g} (CloudWatch, the run's own I/O to {at} UTC)"
            )
        if self.why:
            hours = self.unmeasured_hours(now)
            parts.append(f"{hours:.4f} h x ${b.io_usd_per_hour:g}/h (the launch-time rate: {self.why})")
        return " + ".join(parts)
