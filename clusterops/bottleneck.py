"""Is the network the bottleneck, and what would fix it? A verdict and what-if predictions from a
run's own per-step breakdown (summary.json "breakdown") and the link measured by `fab check`.

The model, per optimizer step (seconds; every input measured, none assumed):
    step = data + compute + exposed + optimizer + other
    comm  = wire_bytes / link_rate                    all-reduce time if nothing overlapped it
    hidden = clamp(comm - exposed, 0, compute)        what backward already hid
A what-if changes one input and recomputes:
    compression (fp16/bf16/PowerSGD): wire bytes x ratio; exposed' = max(0, comm' - hidden')
    faster link: comm x (rate / rate')
    batch x s or accumulation x k: data and compute x s (x k); comm once per optimizer step
A mode that forces one DDP bucket (PowerSGD on gloo) overlaps nothing: hidden' = 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

COMM_BOUND_SHARE = 0.5  # exposed communication at least half the step
INPUT_BOUND_SHARE = 0.3  # waiting for data at least 30% of the step
COMPUTE_BOUND_SHARE = 0.15  # neither communication nor input above 15%
WIRE_RATIO = {"none": 1.0, "fp16": 0.5, "bf16": 0.5}


@dataclass(frozen=True)
class Breakdown:
    """Mean seconds per optimizer step on one rank (the slowest rank's, for a verdict)."""

    data: float
    compute: float
    exposed: float
    optimizer: float
    other: float
    wire_bytes: float  # bytes one rank sends per step (ring all-reduce: 2(N-1)/N of the payload)
    grad_bytes: float  # fp32 gradient bytes (the uncompressed payload)
    world_size: int
    objects_per_step: float
    compression: str = "none"
    single_bucket: bool = False

    @property
    def step(self) -> float:
        return self.data + self.compute + self.exposed + self.optimizer + self.other

    @classmethod
    def from_summary(cls, summary: dict) -> "Breakdown":
        b = summary["breakdown"]
        return cls(
            data=b["data_s"],
            compute=b["compute_s"],
            exposed=b["comm_exposed_s"],
            optimizer=b["optimizer_s"],
            other=b["other_s"],
            wire_bytes=b["wire_bytes"],
            grad_bytes=b["grad_bytes"],
            world_size=summary["world_size"],
            objects_per_step=summary["global_batch"],
            compression=summary.get("grad_compression", "none"),
            single_bucket=bool(b.get("single_bucket", False)),
        )


@dataclass(frozen=True)
class Verdict:
    kind: str  # compute-bound, communication-bound, input-bound or mixed
    evidence: str


@dataclass(frozen=True)
class Prediction:
    name: str
    step_s: float
    objects_per_s: float
    model: str  # the one-line formula behind it
    parts: tuple[tuple[str, float], ...] = ()  # (part, seconds), for the stacked bars

    def speedup_over(self, base: Breakdown) -> float:
        return (self.objects_per_s / (base.objects_per_step / base.step)) if base.step else 0.0


def ring_wire_bytes(payload_bytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `payload_bytes`."""
    return 2 * (world_size - 1) / world_size * payload_bytes if world_size > 1 else 0.0


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


def comm_seconds(b: Breakdown, link_gbit: float) -> float:
    return b.wire_bytes * 8 / (link_gbit * 1e9)


def _hidden(b: Breakdown, link_gbit: float) -> float:
    return min(max(comm_seconds(b, link_gbit) - b.exposed, 0.0), b.compute)


def _predict(
    name: str,
    b: Breakdown,
    model: str,
    *,
    data: float,
    compute: float,
    comm: float,
    hidden: float,
    objects: float,
    extra: float = 0.0,
) -> Prediction:
    exposed = max(0.0, comm - hidden)
    step = data + compute + exposed + b.optimizer + b.other + extra
    parts = (
        ("data", data),
        ("compute", compute + extra),
        ("exposed", exposed),
        ("optimizer", b.optimizer),
        ("other", b.other),
    )
    return Prediction(name, step, objects / step if step else 0.0, model, parts)


def what_ifs(
    b: Breakdown,
    link_gbit: float,
    powersgd_wire_bytes: Optional[float] = None,
    powersgd_overhead_s: float = 0.0,
    powersgd_single_bucket: bool = True,
) -> list[Prediction]:
    """Step time and throughput under each change, from the measured breakdown and link rate."""
    comm, hidden = comm_seconds(b, link_gbit), _hidden(b, link_gbit)
    base = dict(data=b.data, compute=b.compute, objects=b.objects_per_step)
    current = WIRE_RATIO.get(b.compression, 1.0)
    out = [_predict(b.compression, b, "as measured", comm=comm, hidden=hidden, **base)]
    for mode in ("fp16", "bf16"):
        if mode != b.compression:
            ratio = WIRE_RATIO[mode] / current
            out.append(
                _predict(
                    f"{mode} gradients",
                    b,
                    f"wire bytes x {ratio:g}, same overlap",
                    comm=comm * ratio,
                    hidden=hidden,
                    **base,
                )
            )
    if powersgd_wire_bytes is not None and b.compression != "powersgd":
        ratio = powersgd_wire_bytes / b.wire_bytes if b.wire_bytes else 0.0
        overlap = 0.0 if powersgd_single_bucket else hidden
        out.append(
            _predict(
                "powersgd",
                b,
                f"wire bytes x {ratio:.3f}, + {powersgd_overhead_s * 1000:.0f} ms "
                f"compression, {'no overlap (one bucket)' if overlap == 0 else 'same overlap'}",
                comm=comm * ratio,
                hidden=overlap,
                extra=powersgd_overhead_s,
                **base,
            )
        )
    for scale in (2, 4):
        out.append(
            _predict(
                f"batch x{scale} per GPU",
                b,
                f"data and compute x {scale}, communication once",
                data=b.data * scale,
                compute=b.compute * scale,
                comm=comm,
                hidden=min(comm, hidden * scale),
                objects=b.objects_per_step * scale,
            )
        )
    for faster in (10, 25, 100, 400):
        if faster > link_gbit * 1.5:
            out.append(
                _predict(
                    f"{faster} Gbit/s link" + (" (EFA)" if faster >= 100 else ""),
                    b,
                    f"communication x {link_gbit / faster:.3f}",
                    comm=comm * link_gbit / faster,
                    hidden=hidden,
                    **base,
                )
            )
    return out


def powersgd_wire_bytes(
    shapes: list[tuple[int, ...]], rank: int, world_size: int, min_compression_rate: float = 2.0
) -> float:
    """What PyTorch's PowerSGD hook sends per rank per step once compression starts: for each matrix
    (n x m, its 2-D view) the P (n x r) and Q (m x r) factors, each all-reduced; 1-D tensors and
    matrices it would not shrink by `min_compression_rate` (the hook's default 2) uncompressed."""
    payload = 0.0
    for shape in shapes:
        if len(shape) <= 1:
            payload += 4 * (shape[0] if shape else 1)
            continue
        n, m = shape[0], 1
        for size in shape[1:]:
            m *= size
        r = min(rank, n, m)
        payload += 4 * (n + m) * r if (n + m) * r * min_compression_rate < n * m else 4 * n * m
    return ring_wire_bytes(payload, world_size)


def link_rate(link: Optional[dict]) -> Optional[float]:
    """The measured link (Gbit/s) from `fab check`'s link.json: the median pair's TCP rate, else the
    all-reduce bus bandwidth."""
    if not link:
        return None
    return link.get("median_gbit") or link.get("allreduce_busbw_gbit")


def report_lines(name: str, b: Breakdown, link_gbit: Optional[float], predictions: list[Prediction]) -> list[str]:
    """The screen `fab report` prints, and the body of report.md (markdown that reads as text)."""
    v = verdict(b, link_gbit)
    lines = [
        f"# Run {name}: {v.kind}",
        "",
        v.evidence,
        "",
        "| what if | step | objects/s | vs now | model |",
        "|---|---|---|---|---|",
    ]
    for p in predictions:
        lines.append(
            f"| {p.name} | {p.step_s * 1000:.0f} ms | {p.objects_per_s:.0f} | {p.speedup_over(b):.2f}x | {p.model} |"
        )
    if link_gbit is None:
        lines += ["", "No link measurement: run `fab check` for the link and the what-ifs."]
    return lines


def write_report(name: str, summary: dict, link: Optional[dict], out_dir, shapes=None) -> list:
    """report.md and breakdown.png into out_dir; returns the paths written."""
    from pathlib import Path

    from . import plots

    out_dir = Path(out_dir)
    b = Breakdown.from_summary(summary)
    rate = link_rate(link)
    predictions = []
    if rate:
        psgd = powersgd_wire_bytes(shapes, summary.get("powersgd_rank", 4), b.world_size) if shapes else None
        predictions = what_ifs(b, rate, powersgd_wire_bytes=psgd)
    lines = report_lines(name, b, rate, predictions)
    report = out_dir / "report.md"
    report.write_text("\n".join(lines + ["", "![step time](breakdown.png)", ""]))
    rows = [
        (
            "measured",
            {"data": b.data, "compute": b.compute, "exposed": b.exposed, "optimizer": b.optimizer, "other": b.other},
        )
    ]
    rows += [(p.name, dict(p.parts)) for p in predictions[1:] if "batch" not in p.name]  # same batch only
    chart = plots.breakdown_bars(rows, out_dir / "breakdown.png", f"{name}: ms per step, measured and predicted")
    return [report, chart]
