"""`fab scale`: short runs on 1..N nodes of the cluster, the scaling table and its plot.

Weak scaling: the batch per GPU stays fixed, so the global batch grows with the nodes; the table says
so. Every point is repeated and shown with its spread (min-max over repeats), because one run on a
shared machine is not a figure.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from cluster_node.protocol.rundir import Summary
from clusterops import terminal


@dataclass(frozen=True)
class Point:
    nodes: int
    ranks: int
    step_s: list[float]  # per repeat
    objects_per_s: list[float]  # per repeat
    exposed_share: list[float]  # per repeat (exposed communication / step), when measured

    @property
    def throughput(self) -> float:
        return statistics.median(self.objects_per_s)

    @property
    def spread(self) -> float:
        return max(self.objects_per_s) - min(self.objects_per_s)


def point_from_summaries(nodes: int, summaries: Sequence[Summary]) -> Point:
    shares = []
    for summary in summaries:
        parts = summary.breakdown or {}
        step = summary.avg_step_time_s or 0.0
        if parts and step:
            shares.append(parts.get("comm_exposed_s", 0.0) / step)
    return Point(
        nodes,
        summaries[0].world_size or 1,  # a finished run's summary has all three
        [s.avg_step_time_s or 0.0 for s in summaries],
        [s.objects_per_s or 0.0 for s in summaries],
        shares,
    )


def table(points: Sequence[Point], shared_cores: Optional[int] = None) -> str:
    """The weak-scaling table. `shared_cores`: the emulated cluster's ranks all run on this machine's
    cores; where they outnumber them, the table says its speedups understate a real cluster's."""
    base = next((p for p in points if p.nodes == min(q.nodes for q in points)), None)
    repeated = any(len(p.objects_per_s) > 1 for p in points)
    rows = []
    for point in points:
        speedup = point.throughput / base.throughput * base.nodes if base and base.throughput else 0.0
        spread = f" ± {point.spread / 2:.0f}" if len(point.objects_per_s) > 1 else ""
        rows.append(
            {
                "nodes": point.nodes,
                "ranks": point.ranks,
                "step_ms": f"{statistics.median(point.step_s) * 1000:.0f}",
                "objects/s": f"{point.throughput:.0f}{spread}",
                "speedup": f"{speedup:.2f}x",
                "efficiency": f"{speedup / point.nodes:.0%}",
                "exposed_comm": f"{statistics.median(point.exposed_share):.0%}" if point.exposed_share else "n/a",
                "repeats": len(point.step_s),
            }
        )
    columns = ["nodes", "ranks", "step_ms", "objects/s", "speedup", "efficiency", "exposed_comm", "repeats"]
    spread_note = (
        "± is half the spread over repeats" if repeated else "one repeat each: no spread (--repeat 2 gives one)"
    )
    lines = [
        f"weak scaling: fixed batch per GPU; speedup = throughput / the smallest point's x its nodes; {spread_note}"
    ]
    crowded = [p.ranks for p in points if shared_cores and p.ranks > shared_cores]
    if crowded:
        lines.append(
            f"note: {max(crowded)} ranks share this machine's {shared_cores} cores (emulated cluster): each rank "
            "computes slower than alone, so these speedups understate a real cluster's"
        )
    return "\n".join(lines) + "\n" + terminal.table(rows, columns)


def shared_cores(source: str) -> Optional[int]:
    """The cores every rank shares: this machine's on the emulated cluster, none on AWS."""
    return os.cpu_count() if source == "local" else None


def speedups(points: Sequence[Point]) -> tuple[list[float], list[float]]:
    """Speedup over the smallest point, and half the spread, for the plot."""
    base = min(points, key=lambda p: p.nodes)
    unit = base.throughput / base.nodes
    return ([p.throughput / unit for p in points], [p.spread / 2 / unit for p in points])
