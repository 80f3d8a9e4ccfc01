"""The step-time model behind `fab report`'s what-ifs and `--grad-compression auto` (one copy,
`train.stepmodel`, on the nodes and in the controller). Standard library only.

Per optimizer step (seconds; every input measured, none assumed):
    step = data + compute + exposed + optimizer + other
    comm  = max(wire_bytes / link_rate, exposed)      all-reduce time if nothing overlapped it
    hidden = clamp(comm - exposed, 0, compute)        what backward already hid
A what-if changes one input and recomputes:
    compression (fp16/bf16/PowerSGD): wire bytes x ratio, and its measured compression work W runs in
        the DDP comm hook bucket by bucket as backward produces them: bucket k's work overlaps bucket
        k-1's wire time, so over B buckets the all-reduce's side takes
        tail(comm', W) = max(comm', W) + min(comm', W) / B. Backward hides wire time, never the
        hook's work (the same processor does both), so what it hid before, capped at the new wire time:
        exposed' = max(0, tail(comm', W) - min(hidden, comm'))
        (the base run's own work is in its tail too: hidden = tail(comm, W_base) - exposed)
    faster link: comm x (rate / rate')
    batch x s or accumulation x k: data and compute x s (x k); comm once per optimizer step
A mode that runs in one DDP bucket overlaps nothing: hidden' = 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

WIRE_RATIO = {"none": 1.0, "fp16": 0.5, "bf16": 0.5}
MODES = ("none", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class Breakdown:
    """Mean seconds per optimizer step on one rank (for a verdict, the rank the others wait for)."""

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
    buckets: float = 0.0  # DDP buckets per step as measured (0: not counted, taken as 1)
    # Measured on the node, when it was (seconds per step): each mode's own compression work.
    overheads: dict = field(default_factory=dict)
    powersgd_wire_bytes: Optional[float] = None
    powersgd_single_bucket: bool = False  # would PowerSGD run in one DDP bucket here (gloo: yes)

    @property
    def step(self) -> float:
        return self.data + self.compute + self.exposed + self.optimizer + self.other

    @classmethod
    def from_summary(cls, summary: dict) -> "Breakdown":
        b = summary["breakdown"]
        calibration = summary.get("calibration") or {}
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
            buckets=float(b.get("buckets") or 0.0),
            overheads=dict(calibration.get("overhead_s") or {}),
            powersgd_wire_bytes=calibration.get("powersgd_wire_bytes"),
            powersgd_single_bucket=bool(calibration.get("powersgd_single_bucket", False)),
        )


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


def comm_seconds(b: Breakdown, link_gbit: float) -> float:
    """The all-reduce's time: the wire bytes at the link rate, or what the step was seen waiting on it
    when that is longer (an all-reduce below line rate: protocol, stragglers); then every what-if
    scales the time this run really took, and "as measured" is the measured step."""
    return max(b.wire_bytes * 8 / (link_gbit * 1e9), b.exposed)


def hidden_seconds(b: Breakdown, link_gbit: float) -> float:
    if b.single_bucket:
        return 0.0
    return min(max(comm_seconds(b, link_gbit) - b.exposed, 0.0), b.compute)


def _predict(name, b: Breakdown, model: str, *, data, compute, comm, hidden, objects, extra=0.0) -> Prediction:
    exposed = max(0.0, comm - hidden)
    step = data + compute + exposed + b.optimizer + b.other + extra
    parts = (
        ("data", data),
        ("compute", max(0.0, compute + extra)),
        ("exposed", exposed),
        ("optimizer", b.optimizer),
        ("other", b.other),
    )
    return Prediction(name, step, objects / step if step else 0.0, model, parts)


def pipelined(comm: float, work: float, buckets: float) -> float:
    """The all-reduce's side of a step whose hook does `work` seconds of compression over `buckets`
    buckets: each bucket's work overlaps the previous bucket's wire time (one bucket: in series)."""
    return max(comm, work) + min(comm, work) / max(1.0, round(buckets))


def compression_what_if(b: Breakdown, link_gbit: float, mode: str):
    """The step under gradient compression `mode` (None when its wire bytes are unknown)."""
    comm, work = comm_seconds(b, link_gbit), b.overheads.get(mode, 0.0)
    buckets = 1.0 if b.single_bucket else max(1.0, b.buckets)
    own = pipelined(comm, b.overheads.get(b.compression, 0.0), buckets)
    hidden = 0.0 if b.single_bucket else min(max(own - b.exposed, 0.0), b.compute)
    base = dict(data=b.data, compute=b.compute, objects=b.objects_per_step)
    cost = f", {work * 1000:.0f} ms compression pipelined over {buckets:.0f} bucket(s)" if work else ""
    if mode == "powersgd":
        if b.powersgd_wire_bytes is None or not b.wire_bytes:
            return None
        ratio = b.powersgd_wire_bytes / b.wire_bytes
        alone = b.powersgd_single_bucket
        tail = pipelined(comm * ratio, work, 1.0 if alone else buckets)
        shape = "no overlap (one bucket)" if alone else "same overlap"
        return _predict(
            "powersgd",
            b,
            f"wire bytes x {ratio:.3f}{cost}, {shape}",
            comm=tail,
            hidden=0.0 if alone else min(hidden, comm * ratio),
            **base,
        )
    ratio = WIRE_RATIO[mode] / WIRE_RATIO.get(b.compression, 1.0)
    name = "none" if mode == "none" else f"{mode} gradients"
    tail = pipelined(comm * ratio, work, buckets)
    hidden = min(hidden, comm * ratio)  # backward hides wire time, not the hook's work
    return _predict(name, b, f"wire bytes x {ratio:g}{cost}, same overlap", comm=tail, hidden=hidden, **base)


def what_ifs(b: Breakdown, link_gbit: float) -> list[Prediction]:
    """Step time and throughput under each change, from the measured breakdown and link rate."""
    comm, hidden = comm_seconds(b, link_gbit), hidden_seconds(b, link_gbit)
    base = dict(data=b.data, compute=b.compute, objects=b.objects_per_step)
    out = [_predict(b.compression, b, "as measured", comm=comm, hidden=hidden, **base)]
    for mode in MODES:
        if mode != b.compression:
            prediction = compression_what_if(b, link_gbit, mode)
            out += [prediction] if prediction else []
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


def powersgd_payload_bytes(shapes, rank: int, min_compression_rate: float = 2.0) -> float:
    """What PyTorch's PowerSGD hook all-reduces per step once compression starts: for each matrix
    (n x m, its 2-D view) the P (n x r) and Q (m x r) factors; 1-D tensors and matrices it would not
    shrink by `min_compression_rate` (the hook's default 2) uncompressed."""
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
    return payload


def powersgd_wire_bytes(shapes, rank: int, world_size: int, min_compression_rate: float = 2.0) -> float:
    return ring_wire_bytes(powersgd_payload_bytes(shapes, rank, min_compression_rate), world_size)
