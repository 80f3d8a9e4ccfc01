"""Is the network the bottleneck, and what would fix it? A verdict and what-if predictions from a
run's own per-step breakdown (summary.json "breakdown") and the link measured by `fab check`.

The step-time model itself is assets/train/stepmodel.py: the trainer's `--grad-compression auto`
runs the same code on the node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from cluster_node.protocol import clusterdir, rundir
from cluster_node.protocol.rundir import Summary
from train.stepmodel import (  # noqa: F401 - the model's names, for the report's callers
    MODES,
    Breakdown,
    Prediction,
    comm_seconds,
    hidden_seconds,
    powersgd_wire_bytes,
    ring_wire_bytes,
    what_ifs,
)

COMM_BOUND_SHARE = 0.5  # exposed communication at least half the step
INPUT_BOUND_SHARE = 0.3  # waiting for data at least 30% of the step
COMPUTE_BOUND_SHARE = 0.15  # neither communication nor input above 15%


@dataclass(frozen=True)
class Verdict:
    kind: str  # compute-bound, communication-bound, input-bound or mixed
    evidence: str


def verdict(b: Breakdown, link_gbit: Optional[float] = None) -> Verdict:
    shares = (
        {name: value / b.step for name, value in (("exposed", b.exposed), ("data", b.data), ("compute", b.compute))}
        if b.step
        else {}
    )
    evidence = (
        f"step {b.step * 1000:.0f} ms: compute {shares.get('compute', 0):.0%}, exposed communication "
        f"{shares.get('exposed', 0):.0%}, data wait {shares.get('data', 0):.0%}; "
        f"{b.wire_bytes / 1e6:.1f} MB on the wire per step per rank"
    )
    if link_gbit:
        evidence += f" over a {link_gbit:.2f} Gbit/s link ({comm_seconds(b, link_gbit) * 1000:.0f} ms if not hidden)"
    if shares.get("exposed", 0) >= COMM_BOUND_SHARE:
        kind = "communication-bound"
    elif shares.get("data", 0) >= INPUT_BOUND_SHARE and shares["data"] > shares["exposed"]:
        kind = "input-bound"
    elif shares.get("exposed", 0) < COMPUTE_BOUND_SHARE and shares.get("data", 0) < COMPUTE_BOUND_SHARE:
        kind = "compute-bound"
    else:
        kind = "mixed"
    return Verdict(kind, evidence)


def link_rate(link: Optional[dict]) -> Optional[float]:
    """The measured link (Gbit/s) from `fab check`'s link.json: its link_gbit (the median pair over
    NCCL's TCP streams, or on EFA the all-reduce bus bandwidth); older files: the median pair, else
    the bus bandwidth."""
    if not link:
        return None
    return link.get("link_gbit") or link.get("median_gbit") or link.get("allreduce_busbw_gbit")


def evidence_lines(summary: Summary, b: Breakdown, link: Optional[dict]) -> list[str]:
    """What the verdict rests on, beyond the shares: the link measured and where GPU use is known."""
    lines = []
    if link:
        lines.append(
            f"link: median {link.get('median_gbit') or 0:.2f} Gbit/s over {len(link.get('pairs', []))} pair(s) "
            f"({link.get('streams') or 1} TCP stream(s) each), all-reduce bus bandwidth "
            f"{link.get('allreduce_busbw_gbit') or 0:.2f} Gbit/s, measured {link.get('measured_at', '?')}; "
            f"taken as the link: {link_rate(link) or 0:.2f} Gbit/s ({link.get('link_source', 'TCP')})"
        )
    gpu = summary.metrics.get("gpu_util") or (summary.breakdown or {}).get("gpu_util")
    lines.append(f"GPU utilisation: {gpu:.0f}%" if isinstance(gpu, (int, float)) else "GPU utilisation: not measured")
    lines.append(
        f"{b.world_size} rank(s), {b.objects_per_step:.0f} objects per step, compression {b.compression}"
        + (", one DDP bucket (no overlap)" if b.single_bucket else "")
    )
    return lines + [mfu_line(summary, link), warmup_line(summary)]


FAR_FROM_PEAK = 0.25  # below this MFU a step is mostly not the GPU's matrix work: launches, host, waits


def mfu_line(summary: Summary, link: Optional[dict] = None) -> str:
    """The MFU against the datasheet, and against what `fab check` measured on this device (link.json)."""
    device, tflops = summary.peak
    measured = (link or {}).get("matmul_peak") or {}
    if summary.mfu is None:
        return f"MFU: not measured ({device or 'this device'}: no tensor-core peak known)"
    line = f"MFU: {summary.mfu:.1%} of {device}'s {tflops:g} TFLOP/s (datasheet, dense 16-bit) over the steady step"
    if measured.get("device") == device and measured.get("measured_tflops") and tflops:
        reached = measured["measured_tflops"]
        line += (
            f"; `fab check` measured {reached:g} TFLOP/s {measured.get('dtype')} on it: "
            f"{summary.mfu * tflops / reached:.1%} of that"
        )
    return line


def warmup_line(summary: Summary) -> str:
    """The warm-up, which the step time above leaves out: the steady steps' mean."""
    w = summary.warmup
    if not w:
        return "warm-up: not recorded (an older trainer): the step time includes it"
    steady = f"the step time is the mean of {w.get('steady_steps')} steady steps"
    count, seconds = w.get("shapes_warmed"), w.get("shape_warm_s") or 0
    warmed = f" (after {count} batch shapes run once in {seconds:.1f} s)" if count else ""
    if not w.get("settled"):
        return f"warm-up{warmed}: {w.get('note')}; {steady} after the fifth"
    settled = f"{w.get('warmup_steps')} steps, {w.get('warmup_s') or 0:.1f} s until the step time settled"
    return f"warm-up{warmed}: {settled}; {steady}"


def far_from_peak(summary: Summary, b: Breakdown, predictions: list[Prediction]) -> list[str]:
    """On a GPU far from its peak: what a larger batch would give, by the what-if model, and how to check it."""
    larger = next((p for p in predictions if p.name == "batch x4 per GPU"), None)
    if summary.mfu is None or summary.mfu >= FAR_FROM_PEAK or larger is None:
        return []
    speedup = larger.speedup_over(b)
    return [
        "",
        f"MFU {summary.mfu:.1%} is far from the GPU's peak: the step is not mostly matrix work. 4x the batch "
        f"(`--max-tokens` or `--batch-per-gpu` x4) predicts {speedup:.2f}x objects/s, MFU about "
        f"{min(1.0, summary.mfu * speedup):.0%} (`fab report --verify batchx4` measures it).",
    ]


def report_lines(
    name: str, summary: Summary, link: Optional[dict], predictions: list[Prediction], b: Optional[Breakdown] = None
) -> list[str]:
    """The screen `fab report` prints, and the body of report.md (markdown that reads as text)."""
    b = b or Breakdown.from_summary(summary.to_json())
    rate = link_rate(link)
    v = verdict(b, rate)
    lines = [f"# Run {name}: {v.kind}", "", v.evidence, ""]
    lines += [f"- {line}" for line in evidence_lines(summary, b, link)]
    if predictions:
        lines += ["", "| what if | step | objects/s | vs now | model |", "|---|---|---|---|---|"]
    for p in predictions:
        lines.append(
            f"| {p.name} | {p.step_s * 1000:.0f} ms | {p.objects_per_s:.0f} | {p.speedup_over(b):.2f}x | {p.model} |"
        )
    lines += far_from_peak(summary, b, predictions)
    if rate is None:
        lines += [
            "",
            f"No link measurement (no {clusterdir.LINK_JSON}): run `fab check` for the link; compression and link "
            "what-ifs need it. Shown: what the measured exposed time alone predicts.",
        ]
    return lines


def predictions_for(b: Breakdown, rate: Optional[float]) -> list[Prediction]:
    """Every what-if with a link rate; without one, only what the exposed time alone predicts (a
    larger batch: the same communication, paid once per more work)."""
    if rate:
        return what_ifs(b, rate)
    if b.exposed > 0 and b.wire_bytes:
        assumed = b.wire_bytes * 8 / b.exposed / 1e9  # as if nothing were hidden
        return [p for p in what_ifs(b, assumed) if p.name == b.compression or p.name.startswith("batch")]
    return []


def write_report(
    name: str,
    summary: Summary,
    link: Optional[dict],
    out_dir,
    scale: Optional[dict] = None,
    scored: Sequence[str] = (),
    what_ifs: bool = True,
    heading: Sequence[str] = (),
) -> tuple[list[str], list]:
    """report.md, breakdown.png (and scaling.png when a `fab scale` series exists) into out_dir;
    returns the screen's lines and the paths written."""
    from pathlib import Path

    from clusterops.predict import plots

    out_dir = Path(out_dir)
    b = Breakdown.from_summary(summary.to_json())  # the step model (train.stepmodel) reads summary.json's JSON
    predictions = predictions_for(b, link_rate(link)) if what_ifs else []
    lines = [*heading, *report_lines(name, summary, link, predictions, b), *scored]
    rows = [("measured", dict(zip(("data", "compute", "exposed", "optimizer", "other"), _parts(b))))]
    rows += [(p.name, dict(p.parts)) for p in predictions[1:] if "batch" not in p.name]  # same batch only
    written = [
        plots.breakdown_bars(rows, out_dir / rundir.BREAKDOWN_PNG, f"{name}: ms per step, measured and predicted")
    ]
    images = [f"![step time]({rundir.BREAKDOWN_PNG})"]
    if scale and scale.get("points"):
        from clusterops.predict import scaling

        points = [scaling.Point(**point) for point in scale["points"]]
        speedups, spreads = scaling.speedups(points)
        title = f"{scale.get('recipe', '')}: weak scaling"
        written.append(
            plots.scaling_curve([p.nodes for p in points], speedups, spreads, out_dir / rundir.SCALING_PNG, title)
        )
        lines += ["", "## Scaling", "", "```", scaling.table(points), "```"]
        images.append(f"![scaling]({rundir.SCALING_PNG})")
    report = out_dir / rundir.REPORT_MD
    report.write_text("\n".join(lines + [""] + images + [""]))
    return lines, [report] + written


def _parts(b: Breakdown) -> tuple[float, ...]:
    return (b.data, b.compute, b.exposed, b.optimizer, b.other)
