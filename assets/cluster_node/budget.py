"""The run's spend against `fab train --budget-usd`, metered by the supervisor at every poll: the nodes of
the current attempt x their price x the time, plus EFS I/O at the rate fab train measured (the model of
`fab cost`'s projection, clusterops/cost.py). Reached: a STOP the trainer honours at its next step
(`now: ...`: checkpoint without the eval, the spend stops soonest). Stdlib only."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from . import rundir
from .spec import Budget


class Meter:
    def __init__(self, budget: Budget, start: float):
        self.budget, self.last = budget, start
        self.node_hours = self.hours = 0.0

    def add(self, nodes: int, now: float) -> None:
        """`nodes` billed since the last call (a restart changes their number)."""
        hours = max(0.0, now - self.last) / 3600
        self.node_hours += nodes * hours
        self.hours += hours
        self.last = now

    @property
    def nodes_usd(self) -> float:
        return self.node_hours * self.budget.usd_per_node_hour

    @property
    def io_usd(self) -> float:
        return self.hours * self.budget.io_usd_per_hour

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
            f"${b.usd_per_node_hour:g}/h, EFS I/O ${self.io_usd:.2f} = {self.hours:.4f} h x ${b.io_usd_per_hour:g}/h) "
            f"[{b.source}]"
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
