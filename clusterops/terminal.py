"""Plain-text tables and run summaries for the terminal: the lines the fab tasks print."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional, Sequence

from cluster_node.protocol.rundir import Progress, RunState, RunStatus, Summary
from cluster_node.tools import duration

if TYPE_CHECKING:
    from clusterops.inventory import Inventory
    from clusterops.nodes.records import RunFiles

QUIET_AFTER_S = 120  # a running run whose progress is older than this says so


def table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    cells = [[str(row.get(col, "")) for col in columns] for row in rows]
    widths = [max([len(col)] + [len(r[i]) for r in cells]) for i, col in enumerate(columns)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _quiet_seconds(status: Optional[RunStatus], progress: Optional[Progress], now: float) -> Optional[float]:
    """How long a running run has shown no progress (since its start when it has no step yet)."""
    if status is None or status.state != RunState.RUNNING:
        return None
    last = progress.time if progress else None
    if last is None and status.time:
        last = datetime.fromisoformat(status.time.replace("Z", "+00:00")).timestamp()
    return now - last if last is not None else None


def run_line(run_dir: str, state: RunFiles, now: Optional[float] = None) -> str:
    status, progress, summary = state.status, state.progress, state.summary
    parts = [f"run {run_dir}: {status.state if status else 'unknown'}"]
    if state.state == RunState.STOPPED:
        parts[0] += f" (resumable: {resume_hint(run_dir)})"
    quiet = _quiet_seconds(status, progress, time.time() if now is None else now)
    if quiet is not None and quiet > QUIET_AFTER_S:
        parts.append(f"no progress for {quiet / 60:.0f} min" if progress else f"no step yet after {quiet / 60:.0f} min")
    if progress:
        parts.append(f"step {progress.step}/{'?' if progress.max_steps is None else progress.max_steps}")
    if progress and progress.avg_step_time_s:
        parts.append(f"{progress.avg_step_time_s * 1000:.0f} ms/step")
    if progress and progress.eta_s is not None and state.state == RunState.RUNNING:
        parts.append(f"ETA {duration(progress.eta_s)}")
    if status and status.reason:
        parts.append(f"({status.reason})")
    if quality(summary) and state.state != RunState.RUNNING:
        parts.append(quality(summary))
    return " | ".join(parts)


def quality(summary: Optional[Summary]) -> str:
    """A run's result, in one form wherever shown: BLEU and top-1 both 0..100 with one decimal."""
    metrics = summary.metrics if summary else {}
    if metrics.get("bleu") is not None:
        return f"BLEU {metrics['bleu']:.1f}"
    return f"top-1 {metrics['top1']:.1f}%" if metrics.get("top1") is not None else ""


def resume_hint(run_dir: str) -> str:
    """How a stopped run goes on: the same name, its saved settings (clusterops.run.resume)."""
    return f"`fab train --run {run_dir.rstrip('/').rsplit('/', 1)[-1]}` continues from its checkpoint"


def then_stop_line(status: Optional[RunStatus]) -> Optional[str]:
    """What --then-stop did, once the run ended (run-status.json's then_stop); None without it.
    `stopping` is also the last word of a head node that went down before it could write `sent`."""
    then_stop = status.then_stop if status else None
    if then_stop == "failed":
        return (
            "error: --then-stop failed: the cluster keeps running (on AWS, billed): the run's log says why "
            "(`fab logs`); `fab stop-cluster` stops it"
        )
    if status and then_stop == "requested":  # a head that went down before it could write the outcome, started since
        return f"--then-stop was requested when the run ended ({status.time}); `fab status` shows the cluster now"
    return "the cluster is stopping (--then-stop): `fab start` brings it back" if then_stop else None


def after_stop_line(inventory: Inventory, status: Optional[RunStatus]) -> Optional[str]:
    """What the nodes do once `fab stop` ended a run: --then-stop's outcome when the run had it; on AWS, that they
    go on billing until the idle watchdog (idle_minutes) stops them. `status` None: the end is not read yet."""
    if status is not None and status.then_stop:
        return then_stop_line(status)
    if inventory.source != "aws":
        return None
    nodes = len(inventory.nodes)
    price = f" ({nodes} x ${inventory.usd_per_hour:.3f}/h)" if inventory.usd_per_hour else ""
    unless = " unless the run was launched with --then-stop" if status is None else ""
    return (
        f"the nodes keep running, billed{price},{unless} until the idle watchdog stops them (idle_minutes after "
        "the run) or `fab stop-cluster` now"
    )


METRICS = ("eval_loss", "bleu", "exact_match", "top1", "top5")  # the task's eval metrics, in summary.metrics


def summary_lines(summary: Optional[Summary]) -> list[str]:
    if summary is None:
        return []
    shown: list[tuple[str, Any]] = [("steps", summary.steps), ("world_size", summary.world_size)]
    shown += [("avg_step_time_s", summary.avg_step_time_s), ("objects_per_s", summary.objects_per_s)]
    shown += [(key, summary.metrics.get(key)) for key in METRICS]
    shown += [("checkpoint_mb", summary.checkpoint_mb), ("ended", summary.ended)]
    return [  # only what the run measured: a synthetic run has no eval, its eval keys are None
        f"  {key:>16}: {value:.4g}" if isinstance(value, float) else f"  {key:>16}: {value}"
        for key, value in shown
        if value is not None
    ]


def aws_error(error) -> str:
    """A botocore ClientError as "Code: message" on one line (some endpoints answer with a page of HTML)."""
    detail = error.response.get("Error", {})
    return f"{detail.get('Code', 'error')}: {' '.join(str(detail.get('Message', error)).split())[:300]}"


VERSIONS = (("torch", "torch"), ("cuda", "CUDA"), ("nccl", "NCCL"), ("driver", "driver"))


def versions_line(rows: Sequence[dict]) -> tuple[bool, str]:
    """(all nodes agree, one line): the versions they share, or every one that differs and where."""
    differ = []
    for key, label in VERSIONS:
        where: dict[str, list[str]] = {}
        for row in rows:
            where.setdefault(str(row.get(key) or "none"), []).append(row["node"])
        if len(where) > 1:
            differ.append(f"{label} " + " vs ".join(f"{value} on {','.join(nodes)}" for value, nodes in where.items()))
    if differ:
        return False, "versions differ between nodes: " + "; ".join(differ)
    return True, "versions: " + ", ".join(
        f"{label} {rows[0].get(key) or 'none'}" for key, label in VERSIONS
    ) + f" on all {len(rows)} nodes"


def status_row(found: dict) -> dict:
    """`fab status`'s row for a node from its cluster_node.programs.node_status JSON."""
    rows = found["gpus"]
    gpu_text = "none (CPU)" if rows is None else f"{len(rows)}: " + " ".join(f"{u}% {m}/{t}MiB" for u, m, t in rows)
    deploy = found.get("deploy")
    return {
        "bootstrap": "yes" if found["ready"] else "no",
        "container": "up",
        "data": "yes" if found["mounted"] else "no",
        "gpus": gpu_text,
        "training": f"{found['training']} rank(s)" if found["training"] else "no",
        "deploy": _span(deploy["total_s"]) if deploy else "-",
    }


def _span(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else f"{int(round(seconds)) // 60}m{int(round(seconds)) % 60:02d}s"


def deploy_line(node: str, deploy: dict) -> str:
    """One node's deploy timeline (node_status's "deploy"): its total, when it began, each step's time."""
    began = datetime.fromtimestamp(deploy["started"], timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    steps = ", ".join(f"{step} {_span(seconds)}{'' if ok else ' FAILED'}" for step, seconds, ok in deploy["steps"])
    return f"{node} deploy {_span(deploy['total_s'])} from {began}: {steps}"
