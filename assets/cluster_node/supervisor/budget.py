"""The run's spend against `fab train --budget-usd`, metered by the supervisor at every poll (and during a
restart): every node that still bills (on AWS: in EC2's state at that reading, ec2state.py) x its price x the
time, plus EFS I/O: on AWS the bytes CloudWatch counted since this segment's start x the read and write
prices, asked every few minutes (efsio.py); without CloudWatch, the rate fab train measured in the hour before
the launch (the model of `fab cost`'s projection, clusterops/cost.py); on top of what the run's earlier
segments spent (budget.json, carried over by `fab train --run NAME`). Reached: a STOP the trainer honours at
its next step (`now: ...`: checkpoint without the eval, the spend stops soonest). Stdlib only (efsio and
ec2state import boto3 when they ask AWS)."""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Optional

from cluster_node.protocol import rundir
from cluster_node.protocol.spec import Budget, RunSpec
from cluster_node.supervisor.ec2state import Ec2Billing
from cluster_node.supervisor.efsio import EfsIo

SPOT_WARNING_S = 120.0  # a notice without a time: EC2 acts two minutes after it (the notice's contract)


@dataclass(frozen=True)
class Spend(rundir.Record):
    """budget.json: the limit and what the run spent over all its segments, rewritten at every meter reading."""

    FILE: ClassVar[str] = rundir.BUDGET
    usd: float = rundir._key("float", required=True)
    spent: float = rundir._key("float", required=True)
    time: float = rundir._key("float", required=True)  # epoch s of the reading
    nodes: Optional[int] = rundir._key("int")  # the nodes billing at that reading
    io_to: Optional[float] = rundir._key("float")  # epoch s: EFS I/O after it is in `spent` as io_estimate only
    io_estimate: Optional[float] = rundir._key("float")  # $ at the launch-time rate: a resume measures it instead


def epoch(iso: Optional[str]) -> Optional[float]:
    try:
        return float(calendar.timegm(time.strptime(iso or "", "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None


class Meter:
    def __init__(self, budget: Budget, start: float, nodes: Optional[int] = None):
        self.budget, self.start, self.last = budget, start, start
        self.cluster = budget.nodes or nodes or 1  # a spec from an older fab: its pool
        self.node_hours = 0.0
        self.efs = EfsIo(budget, start)
        self.stopped = ""  # the budget line, once the spend reached the budget and the STOP is written
        self.unsaved = False  # budget.json could not be written at the last reading (logged once)
        # On AWS: the nodes that bill from EC2's state at every reading (a Spot node EC2 restarts bills again).
        ids, region = budget.instance_ids, budget.region
        self.ec2 = Ec2Billing(ids, region, budget.nodes or len(ids)) if ids else None
        self.ec2_why = ""  # the EC2 failure last logged

    @classmethod
    def of(cls, spec: RunSpec, start: float) -> Optional[Meter]:
        return cls(spec.budget, start, len(spec.pool)) if spec.budget else None

    def billing(self, run: Path, now: float) -> int:
        """Without instance ids (the emulated cluster, a spec from an older fab): the cluster's nodes less
        those a Spot notice since this supervisor started took away: EC2 bills an
        interrupted Spot node for the seconds it ran, until its action (stop/terminate/hibernate), then no more
        (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/billing-for-interrupted-spot-instances.html)."""
        gone = set()
        for notice in rundir.read_list(run / rundir.INTERRUPTIONS, rundir.Interruption):
            noticed = epoch(notice.noticed)
            if noticed is None or noticed < int(self.start):  # an earlier segment's: EC2 started it again
                continue
            if (epoch(notice.action_time) or noticed + SPOT_WARNING_S) <= now:
                gone.add(notice.instance_id or notice.host or notice.node)
        return max(0, self.cluster - len(gone))

    def add(self, nodes: int, now: float) -> None:
        """`nodes` billed since the last call."""
        hours = max(0.0, now - self.last) / 3600
        self.node_hours += nodes * hours
        self.last = now
        self.efs.update(now)

    @property
    def nodes_usd(self) -> float:
        return self.node_hours * self.budget.usd_per_node_hour

    @property
    def io_usd(self) -> float:
        return self.efs.usd(self.last)

    @property
    def spent(self) -> float:
        return self.budget.spent + self.nodes_usd + self.io_usd

    @property
    def reached(self) -> bool:
        return self.spent >= self.budget.usd

    def line(self, step: Optional[int]) -> str:
        b = self.budget
        earlier = f"earlier segments ${b.spent:.2f}, " if b.spent else ""
        return (
            f"budget: ${b.usd:.2f} reached at step {step if step is not None else 'none yet'} "
            f"(${self.spent:.2f} spent: {earlier}nodes ${self.nodes_usd:.2f} = {self.node_hours:.4f} node-h x "
            f"${b.usd_per_node_hour:g}/h, EFS I/O ${self.io_usd:.2f} = {self.efs.describe(self.last)}) [{b.source}]"
        )

    def save(self, run: Path, now: float, log: Callable[[str], None] = print) -> None:
        """Meter up to `now` and save the spend (a crash or a stopped head node loses one poll of it at most).
        A write EFS refuses (ENOSPC, a stale handle) is logged once and retried at the next poll: the meter
        counts on in memory and the run goes on."""
        # As at the interval's start (with EC2: the more of its start and end): a node going mid-interval counts whole
        nodes = self._ec2_nodes(log) if self.ec2 else self.billing(run, self.last)
        self.add(nodes, now)
        io_to, estimate = self.efs.counted_to(now), self.efs.estimated_usd(now)
        spend = Spend(usd=self.budget.usd, spent=self.spent, time=now, nodes=nodes, io_to=io_to, io_estimate=estimate)
        try:
            rundir.write_record(run / rundir.BUDGET, spend)
        except OSError as error:
            if not self.unsaved:
                log(f"launcher: could not save {rundir.BUDGET} ({error}); metering on in memory, retried every poll")
            self.unsaved = True
            return
        self.unsaved = False

    def _ec2_nodes(self, log: Callable[[str], None]) -> int:
        assert self.ec2 is not None
        nodes = self.ec2.update()
        if self.ec2.why and self.ec2.why != self.ec2_why:
            log(f"launcher: the budget meter cannot read the nodes' state ({self.ec2.why}); metering {nodes} node(s)")
        self.ec2_why = self.ec2.why
        return nodes

    def check(self, run: Path, now: float, log: Callable[[str], None]) -> str:
        """save(); the first time the spend reaches the budget, write the STOP and log it. Returns the budget
        line once reached, else ""."""
        self.save(run, now, log)
        if self.stopped or not self.reached:
            return self.stopped
        progress = rundir.read_json(run / rundir.PROGRESS, {}) or {}
        self.stopped = self.line(progress.get("step"))
        rundir.write_bytes(run / rundir.STOP, f"{rundir.URGENT_STOP_WORD}: {self.stopped}\n".encode())
        log(f"launcher: {self.stopped}; asked the trainer to checkpoint and end")
        return self.stopped
