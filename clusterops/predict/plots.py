"""PNG plots for `fab report` and `fab scale` (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

PARTS = (
    ("data", "data wait"),
    ("compute", "forward + backward"),
    ("exposed", "exposed communication"),
    ("optimizer", "optimizer"),
    ("other", "other"),
)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def breakdown_bars(rows: Sequence[tuple[str, dict]], path: Path, title: str) -> Path:
    """Stacked bars: one per (label, {part: seconds}), in milliseconds per step."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(max(4.0, 1.4 * len(rows) + 2), 4.0))
    bottoms = [0.0] * len(rows)
    labels = [label for label, _ in rows]
    for key, name in PARTS:
        heights = [parts.get(key, 0.0) * 1000 for _, parts in rows]
        axes.bar(labels, heights, bottom=bottoms, label=name)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    axes.set_ylabel("ms per step")
    axes.tick_params(axis="x", labelrotation=20)
    axes.set_title(title)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def scaling_curve(
    nodes: Sequence[int], speedups: Sequence[float], spreads: Sequence[float], path: Path, title: str
) -> Path:
    """Measured speedup (with its spread over repeats) against the ideal line."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(5.0, 4.0))
    axes.plot(nodes, nodes, linestyle="--", color="grey", label="ideal")
    axes.errorbar(nodes, speedups, yerr=spreads, marker="o", capsize=4, label="measured")
    axes.set_xlabel("nodes")
    axes.set_ylabel("throughput / one node's")
    axes.set_xticks(list(nodes))
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


GOODPUT_COLOURS = {
    "productive": "tab:green",
    "startup": "tab:blue",
    "eval": "tab:purple",
    "checkpoint": "tab:olive",
    "restart": "tab:red",
    "recomputed": "tab:orange",
    "stall": "tab:brown",
    "shutdown": "tab:grey",
    "unaccounted": "white",
}
INCIDENT_PARTS = (
    ("detect_s", "detect"),
    ("decide_s", "decide"),
    ("relaunch_s", "relaunch"),
    ("first_step_s", "first step"),
)


def goodput_timeline(account, path: Path, title: str) -> Path:
    """The run's wall-clock as one bar coloured by cause (cluster_node.supervisor.goodput), and under it one bar per
    restart: detect -> decide -> relaunch -> first step, with the steps it lost."""
    plt = _pyplot()
    rows = 1 + len(account.incidents)
    figure, axes = plt.subplots(figsize=(10.0, 1.2 + 0.6 * rows))
    for group, colour in GOODPUT_COLOURS.items():
        bars = [(a, b - a) for label, a, b in account.segments if label.split(".")[0] == group]
        if bars:
            seconds = account.group(group)
            axes.broken_barh(bars, (rows - 0.4, 0.8), color=colour, label=f"{group} {seconds:.0f} s")
    for i, incident in enumerate(account.incidents):
        start, y = incident.at_s, rows - 1 - i
        for (key, name), colour in zip(INCIDENT_PARTS, ("tab:red", "tab:pink", "tab:cyan", "tab:blue"), strict=True):
            width = getattr(incident, key)
            axes.broken_barh([(start, width)], (y - 0.3, 0.6), color=colour, label=name if i == 0 else None)
            start += width
        axes.text(start, y, f" {incident.kind}: {incident.steps_lost} steps lost", va="center", fontsize="small")
    axes.set_yticks([rows - i for i in range(rows)], ["run", *(f"restart {i}" for i in range(1, rows))])
    axes.set_xlabel("seconds from the run's start")
    axes.set_title(f"{title}: goodput {account.goodput:.0%} of {account.wall_s:.0f} s")
    axes.legend(fontsize="x-small", ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
