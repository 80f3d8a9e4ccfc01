"""Plain-text tables and run summaries for the terminal."""
from __future__ import annotations

from typing import Sequence


def table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    cells = [[str(row.get(col, "")) for col in columns] for row in rows]
    widths = [max([len(col)] + [len(r[i]) for r in cells]) for i, col in enumerate(columns)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def run_line(run_dir: str, state: dict) -> str:
    status, progress, summary = state["status"], state["progress"], state["summary"]
    parts = [f"run {run_dir}: {status.get('state', 'unknown')}"]
    if progress.get("step") is not None:
        parts.append(f"step {progress['step']}/{progress.get('max_steps', '?')}")
    if progress.get("avg_step_time_s"):
        parts.append(f"{progress['avg_step_time_s'] * 1000:.0f} ms/step")
    if status.get("reason"):
        parts.append(f"({status['reason']})")
    if summary.get("bleu") is not None and status.get("state") != "running":
        parts.append(f"BLEU {summary['bleu']:.1f}")
    return " | ".join(parts)


def summary_lines(summary: dict) -> list[str]:
    keys = ("steps", "world_size", "avg_step_time_s", "objects_per_s", "eval_loss", "bleu",
            "exact_match", "checkpoint_mb", "ended")
    return [f"  {key:>16}: {summary[key]:.4g}" if isinstance(summary.get(key), float)
            else f"  {key:>16}: {summary.get(key)}" for key in keys if key in summary]


def aws_error(error) -> str:
    """A botocore ClientError as "Code: message" on one line (some endpoints answer with a page of HTML)."""
    detail = error.response.get("Error", {})
    return f"{detail.get('Code', 'error')}: {' '.join(str(detail.get('Message', error)).split())[:300]}"
