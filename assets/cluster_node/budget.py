"""The run's spend against `fab train --budget-usd`, metered by the supervisor at every poll: the nodes of
the current attempt x their price x the time, plus EFS I/O: on AWS the bytes CloudWatch counted since the
run's start x the read and write prices, asked every few minutes (efsio.py); without CloudWatch, the rate
fab train measured in the hour before the launch (the model of `fab cost`'s projection, clusterops/cost.py).
Reached: a STOP the trainer honours at its next step (`now: ...`: checkpoint without the eval, the spend
stops soonest). Stdlib only (efsio imports boto3 when it asks CloudWatch)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from . import rundir
from .efsio import EfsIo
from .spec import Budget


class Meter:
    def __init__(self, budget: Budget, start: float):
        self.budget, self.last = budget, start
        self.node_hours = 0.0
        self.efs = EfsIo(budget, start)

    def add(self, nodes: int, now: float) -> None:
        """`nodes` billed since the last call (a restart changes their number)."""
        self.node_hours += nodes * max(0.0, now - self.last) / 3600
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
        return self.nodes_usd + self.io_usd

    @property
    def reached(self) -> bool:
        return self.spent >= self.budget.usd

    def line(self, step: Optional[int]) -> str:
        b = self.budget
        return (
            f"budget: ${b.usd:.2f} reached at step {step if step is not None else 'none yet'} "
            f"(${self.spent:.2f} spent: nodes ${self.nodes_usd:.2f} = {self.node_hours:.4f} node-h x "
            f"${b.usd_per_node_hour:g}/h, EFS I/O ${self.io_usd:.2f} = {self.efs.describe(self.last)}) [{b.source}]"
        )

    def check(self, run: Path, nodes: int, now: float) -> str:
        """The budget line once the spend reached the budget (the STOP written), else ""."""
        self.add(nodes, now)
        if not self.reached:
            return ""
        progress = rundir.read_json(run / rundir.PROGRESS, {}) or {}
        line = self.line(progress.get("step"))
        rundir.write_bytes(run / rundir.STOP, f"{rundir.URGENT_STOP_WORD}: {line}\n".encode())
        return line
