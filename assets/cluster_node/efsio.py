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
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional

READ_METRICS = ("DataReadIOBytes", "MetadataReadIOBytes")
WRITE_METRICS = ("DataWriteIOBytes", "MetadataWriteIOBytes")
QUERY_S = 180.0  # CloudWatch lags 1-2 min; 4 GetMetricStatistics calls each time ($0.01 per 1,000)
MAX_DATAPOINTS = 1440  # GetMetricStatistics' limit per call


def period_s(start: datetime, end: datetime) -> int:
    """A multiple of 60 s that covers start..end in at most MAX_DATAPOINTS points (and is >= 300 s once the
    window is older than 15 days, when 1-minute data is gone: 15 days / 1440 = 900 s)."""
    seconds = max(60.0, (end - start).total_seconds())
    return max(60, math.ceil(seconds / MAX_DATAPOINTS / 60) * 60)


def io_gb(cloudwatch, file_system_id: str, start: datetime, end: datetime) -> tuple[float, float]:
    """GB (1e9 bytes) read and written through the file system between start and end, data and metadata."""
    period = period_s(start, end)
    dimensions = [{"Name": "FileSystemId", "Value": file_system_id}]

    def total(metric: str) -> float:
        points = cloudwatch.get_metric_statistics(
            Namespace="AWS/EFS",
            MetricName=metric,
            StartTime=start,
            EndTime=end,
            Period=period,
            Dimensions=dimensions,
            Statistics=["Sum"],
        )["Datapoints"]
        return sum(point["Sum"] for point in points) / 1e9

    return sum(map(total, READ_METRICS)), sum(map(total, WRITE_METRICS))


def client(region: str):
    """A CloudWatch client that gives up in seconds: the supervisor's loop waits for it."""
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 2, "mode": "standard"})
    return boto3.client("cloudwatch", region_name=region, config=config)


def measure(file_system_id: str, region: str, start: float, end: float) -> tuple[float, float]:
    """io_gb between two epoch times. RuntimeError with one line when CloudWatch cannot answer."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        raise RuntimeError("boto3 is not installed here") from None
    utc = timezone.utc
    try:
        when = datetime.fromtimestamp(start, utc), datetime.fromtimestamp(end, utc)
        return io_gb(client(region), file_system_id, *when)
    except (BotoCoreError, ClientError) as error:
        raise RuntimeError(str(error).splitlines()[0]) from None


@dataclass(frozen=True)
class Reading:
    read_gb: float
    write_gb: float
    at: float  # the end of the window (epoch seconds)


class EfsIo:
    """The run's EFS I/O dollars: CloudWatch's bytes since `start` x the read and write prices; without
    CloudWatch (no file system id, an API error) the launch-time $/hour for the time not measured."""

    def __init__(self, budget, start: float, measure=measure):
        self.budget, self.start, self.measure = budget, start, measure
        self.reading: Optional[Reading] = None
        self.asked: Optional[float] = None
        self.why = "" if budget.file_system_id else "no file system to meter"

    def update(self, now: float) -> None:
        """Ask CloudWatch when QUERY_S has passed since the last question."""
        due = self.asked is None or now - self.asked >= QUERY_S
        if not self.budget.file_system_id or not due or now <= self.start:
            return
        self.asked = now
        try:
            read, write = self.measure(self.budget.file_system_id, self.budget.region, self.start, now)
        except RuntimeError as error:
            self.why = f"CloudWatch: {error}"
            return
        self.reading, self.why = Reading(read, write, now), ""

    @property
    def measured_usd(self) -> float:
        r, b = self.reading, self.budget
        return r.read_gb * b.io_read_usd_per_gb + r.write_gb * b.io_write_usd_per_gb if r else 0.0

    def unmeasured_hours(self, now: float) -> float:
        """Hours charged at the launch-time rate: none while CloudWatch answers."""
        if not self.why:
            return 0.0
        return max(0.0, now - (self.reading.at if self.reading else self.start)) / 3600

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
        if self.why:
            hours = self.unmeasured_hours(now)
            parts.append(f"{hours:.4f} h x ${b.io_usd_per_hour:g}/h (the launch-time rate: {self.why})")
        return " + ".join(parts)
