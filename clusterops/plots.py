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
