"""`fab plan`: time and dollars to a target before paying, for N = 1..k nodes of one or more instance
types, from a measured run (its summary.json breakdown, the link) or a given step time. Pure: the
task reads the run's files and the prices and passes them in.

Scaling across N keeps the measured run's GLOBAL batch (the supervisor does the same when a node
drops): the optimisation is the same step for step, so a target step count, or the step an earlier
run's eval curve reached a metric at, holds at every N. Per optimizer step, R = nodes x GPUs ranks:
    data, compute: x R0/R (each rank does 1/R of the batch), / the GPU speed factor for compute
    comm: ring all-reduce, 2(R-1)/R x payload at the link rate (x the base run's measured slowdown
                               against its link), hidden behind backward as much as the base run hid,
                               at most the new compute; a 1-rank base hid nothing we could measure: none
    optimizer, other: as measured (each rank steps the whole model)
A launch at another global batch (`--budget-usd`'s: the same batch per GPU on more ranks) scales data
and compute by its batch against the base's (step_at's `batch`); the rest count once a step.
Across instance types: the ratio of the GPUs' peak dense FP16 tensor throughput (NVIDIA data sheets,
an upper bound on the speed-up); from a run on CPU (the emulated cluster) no GPU's compute is
predicted: plan() says so and asks for a short run on that type.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from cluster_node.protocol import rundir
from cluster_node.protocol.rundir import Summary
from clusterops.cost import HOURS_PER_MONTH, TABLE, efs_io_usd
from clusterops.predict.bottleneck import Breakdown, comm_seconds, hidden_seconds, ring_wire_bytes
from stacks.config import ClusterConfig

# Peak dense FP16 tensor TFLOPS (sparsity off), from NVIDIA's data sheets: T4 (65), V100 SXM2 (125),
# A100 SXM (312), L4 (121: 242 with sparsity), L40S (362), H100 SXM (989). A10G (g5) has no NVIDIA
# data sheet of its own: not guessed.
GPU_TFLOPS = {"T4": 65.0, "V100": 125.0, "A100": 312.0, "L4": 121.0, "L40S": 362.0, "H100": 989.0}
CPU = "cpu"  # what a run on the emulated cluster ran on


class PlanError(ValueError):
    """What the plan cannot be made from, in one line."""


@dataclass(frozen=True)
class Base:
    """What the plan starts from: one measured run, or a given step time as all compute."""

    breakdown: Breakdown
    gpu: str  # the GPU model it ran on, or CPU
    ranks_per_node: int
    link_gbit: Optional[float]  # the link it ran over (measured, else the cap)
    source: str  # one line: which run or which given figure
    precision: str = "fp16"  # what its compute ran in (summary.json); fp32 does not scale by FP16 figures

    @property
    def nodes(self) -> int:
        return max(1, self.breakdown.world_size // max(1, self.ranks_per_node))


@dataclass(frozen=True)
class Offer:
    """One instance type to plan for: price per node-hour, GPUs per node, the link between nodes."""

    instance_type: str
    gpu: str
    gpus_per_node: int
    usd_per_hour: Optional[float]
    price_source: str
    link_gbit: Optional[float]
    link_source: str
    machine_cpus: int = 0  # the emulated cluster: the machine's CPUs, which its nodes split


def cpu_share(nodes: int, cpus: int) -> float:
    """CPUs the busiest emulated node gets (localcluster.node_cpus: an equal slice each; more nodes than
    CPUs share them all, equally)."""
    return float(cpus // nodes) if nodes <= cpus else cpus / nodes


@dataclass(frozen=True)
class Storage:
    root_gb: float = ClusterConfig.root_volume_gb  # per node: the stack's default
    efs_gb: float = 0.0
    read_gb: float = 0.0  # EFS bytes read over the run (the data set x epochs)
    write_gb: float = 0.0  # checkpoints written


@dataclass(frozen=True)
class Estimate:
    instance_type: str
    nodes: int
    step_s: Optional[float]
    hours: Optional[float]
    usd_nodes: Optional[float]
    usd_storage: Optional[float]
    usd_io: Optional[float]
    models: tuple[tuple[str, str], ...]  # (figure, its one-line model)
    refused: str = ""

    @property
    def usd_total(self) -> Optional[float]:
        parts = [part for part in (self.usd_nodes, self.usd_storage, self.usd_io) if part is not None]
        return sum(parts) if len(parts) == 3 else None


def base_from_run(name: str, summary: Optional[Summary], gpu: str, ranks_per_node: int, link: tuple) -> Base:
    """The plan's base from a finished run's summary.json and the link (rate, where it comes from)."""
    if summary is None or not summary.breakdown:
        raise PlanError(f"run {name} has no {rundir.SUMMARY} breakdown (not finished, or an older trainer)")
    b = Breakdown.from_summary(summary.to_json())  # the step model reads summary.json's JSON
    where = f"run {name}: {b.world_size} rank(s) on {gpu}, {b.step * 1e3:.0f} ms/step as measured"
    return Base(b, gpu, ranks_per_node, link[0], f"{where}; link {link[1]}", summary.precision or "fp16")


def base_from_step(step_s: float, grad_mb: float, gpu: str, instance_type: str, objects: float = 1.0) -> Base:
    """A given step time on one node of `instance_type`: all compute, `grad_mb` MB of fp32 gradients."""
    b = Breakdown(0.0, step_s, 0.0, 0.0, 0.0, 0.0, grad_mb * 1e6, 1, objects)
    where = f"given: {step_s * 1e3:.0f} ms/step on 1 {instance_type} rank, {grad_mb:g} MB of gradients"
    return Base(b, gpu, 1, None, where)


def speed_factor(base: Base, offer: Offer) -> tuple[Optional[float], str]:
    """How much faster the offer's GPU computes than the base's, or None with why not."""
    if offer.gpu == base.gpu:
        return 1.0, f"same GPU ({base.gpu})"
    if base.gpu == CPU:
        return None, (
            f"the run was measured on CPU (the emulated cluster): {offer.gpu} compute is not predicted from it; "
            f"measure a short run on {offer.instance_type} and plan from that"
        )
    if base.gpu not in GPU_TFLOPS or offer.gpu not in GPU_TFLOPS:
        unknown = base.gpu if base.gpu not in GPU_TFLOPS else offer.gpu
        return None, f"no published dense FP16 figure for {unknown}: measure a short run on {offer.instance_type}"
    if base.precision not in ("fp16", "bf16"):  # T4 fp32 8.1 TFLOPS against A100 TF32 156: 19x, not 4.8x
        return None, (
            f"the run computed in {base.precision}: FP16 figures do not scale it to {offer.gpu}; plan from a run "
            f"with --precision fp16 or bf16, or measure a short run on {offer.instance_type}"
        )
    factor = GPU_TFLOPS[offer.gpu] / GPU_TFLOPS[base.gpu]
    return factor, f"{offer.gpu}/{base.gpu} peak FP16 {GPU_TFLOPS[offer.gpu]:g}/{GPU_TFLOPS[base.gpu]:g} TFLOPS"


def payload_bytes(b: Breakdown) -> float:
    """The bytes one all-reduce carries: from the measured wire bytes, else the gradients."""
    if b.world_size > 1 and b.wire_bytes:
        return b.wire_bytes * b.world_size / (2 * (b.world_size - 1))
    return b.grad_bytes * (0.5 if b.compression in ("fp16", "bf16") else 1.0)


def step_at(
    base: Base, ranks: int, link_gbit: Optional[float], speed: float = 1.0, batch: float = 1.0
) -> tuple[float, str]:
    """The step on `ranks` ranks at the base run's global batch (x `batch`: a launch's own, larger or
    smaller; each rank's data and compute grow with it, the all-reduce and the optimizer do not), and its
    one-line model."""
    b = base.breakdown
    share = b.world_size / ranks * batch
    compute, data = b.compute * share / speed, b.data * share
    wire = ring_wire_bytes(payload_bytes(b), ranks)
    if ranks > 1 and wire and not link_gbit:
        raise PlanError("no link rate to price the all-reduce: run `fab check`, or give --link-gbit")
    comm = wire * 8 / (link_gbit * 1e9) if ranks > 1 and wire and link_gbit else 0.0
    slow, hidden, why = 1.0, 0.0, "none hidden (1-rank base)"
    if b.world_size > 1 and base.link_gbit and b.wire_bytes:
        slow = comm_seconds(b, base.link_gbit) / (b.wire_bytes * 8 / (base.link_gbit * 1e9))
        hidden, why = min(hidden_seconds(b, base.link_gbit), compute), "hidden as measured"
    comm *= slow
    exposed = max(0.0, comm - hidden)
    step = data + compute + exposed + b.optimizer + b.other
    model = (
        f"data {data * 1e3:.0f} + compute {b.compute * 1e3:.0f} x {b.world_size}/{ranks}"
        + (f" x {batch:.3g} (the global batch)" if batch != 1 else "")
        + (f" / {speed:.2f}" if speed != 1 else "")
        + f" + exposed max(0, ring {wire / 1e6:.1f} MB at {link_gbit or 0:.2f} Gbit/s"
        + (f" x {slow:.2f} measured" if slow != 1 else "")
        + f" - {hidden * 1e3:.0f} {why}) + opt {b.optimizer * 1e3:.0f} + other {b.other * 1e3:.0f} ms"
    )
    return step, model


def estimate(
    base: Base, offer: Offer, nodes: int, steps: int, storage: Storage, spot_note: str = "", batch: float = 1.0
) -> Estimate:
    """One (type, N): step, time, and dollars for nodes, storage and EFS I/O, each with its model; `batch`:
    the global batch against the base run's (step_at)."""
    speed, speed_why = speed_factor(base, offer)
    if speed is not None and offer.machine_cpus:  # the emulated cluster: N nodes split the machine's CPUs
        share, was = cpu_share(nodes, offer.machine_cpus), cpu_share(base.nodes, offer.machine_cpus)
        speed, speed_why = speed * share / was, f"{share:g} CPU(s) per node against {was:g} in the run"
    if speed is None:
        return Estimate(offer.instance_type, nodes, None, None, None, None, None, (), speed_why)
    try:
        step, model = step_at(base, nodes * offer.gpus_per_node, offer.link_gbit, speed, batch)
    except PlanError as error:
        return Estimate(offer.instance_type, nodes, None, None, None, None, None, (), str(error))
    hours = steps * step / 3600
    price = offer.usd_per_hour
    usd_nodes = None if price is None else nodes * price * hours
    months = hours / HOURS_PER_MONTH
    ebs = nodes * storage.root_gb * TABLE["gp3_usd_per_gb_month"] * months
    efs = storage.efs_gb * TABLE["efs_standard_usd_per_gb_month"] * months
    io = efs_io_usd(storage.read_gb, storage.write_gb)
    models = (
        ("step", f"{step * 1e3:.0f} ms = {model}" + (f"; speed: {speed_why}" if speed != 1 else "")),
        ("time", f"{_hours(hours)} = {steps} steps x {step:.3f} s (steps only: start-up, eval, checkpoints not)"),
        (
            "nodes",
            f"{_usd(usd_nodes)} = {nodes} x {_usd(price, 4)}/h x {hours:.3f} h [{offer.price_source}]{spot_note}",
        ),
        (
            "storage",
            f"${ebs + efs:.2f} = ({nodes} x {storage.root_gb:g} GB EBS x ${TABLE['gp3_usd_per_gb_month']} + "
            f"{storage.efs_gb:g} GB EFS x ${TABLE['efs_standard_usd_per_gb_month']}) per month x {months:.5f} months",
        ),
        (
            "EFS I/O",
            f"${io:.2f} = {storage.read_gb:g} GB read x ${TABLE['efs_elastic_read_usd_per_gb']} + "
            f"{storage.write_gb:g} GB written x ${TABLE['efs_elastic_write_usd_per_gb']}",
        ),
    )
    return Estimate(offer.instance_type, nodes, step, hours, usd_nodes, ebs + efs, io, models)


def plan(
    base: Base, offers: Sequence[Offer], max_nodes: int, steps: int, storage: Storage, spot_note: str = ""
) -> list[Estimate]:
    return [estimate(base, o, n, steps, storage, spot_note) for o in offers for n in range(1, max_nodes + 1)]


def cheapest(estimates: Sequence[Estimate], deadline_h: Optional[float]) -> Optional[Estimate]:
    """The cheapest priced estimate within the deadline (ties: the faster)."""
    fits = [
        e
        for e in estimates
        if e.usd_total is not None and e.hours is not None and (deadline_h is None or e.hours <= deadline_h)
    ]
    return min(fits, key=lambda e: (e.usd_total, e.hours)) if fits else None


# ---------------------------------------------------------------- the target


EVAL_LINE = re.compile(r"^eval step (\d+) \| (.+)$", re.M)


def eval_curve(log_text: str) -> list[tuple[int, dict[str, float]]]:
    """The run's evaluations, in order, from the trainer's `eval step N | name value | ...` lines of
    train.log (the same figures go to TensorBoard as eval/NAME)."""
    curve = []
    for found in EVAL_LINE.finditer(log_text):
        values = {}
        for part in found.group(2).split(" | "):
            name, _, value = part.strip().partition(" ")
            try:
                values[name] = float(value)
            except ValueError:
                continue
        curve.append((int(found.group(1)), values))
    return curve


PERCENT = ("bleu", "top1", "top5")  # as the trainer reports them: 0..100


def parse_metric(text: str) -> tuple[str, float]:
    """`bleu=60` -> ("bleu", 60.0); one line naming the form otherwise. BLEU and top-1/top-5 are in percent,
    as the trainer reports them: a target outside 0..100, or a fraction like top1=0.8, is refused."""
    found = re.fullmatch(r"([a-z_0-9]+)=(-?\d+(?:\.\d+)?)(%?)", (text or "").strip())
    if not found:
        raise PlanError(f"invalid --metric {text!r}: NAME=VALUE, e.g. bleu=60 or top1=80 (percent)")
    name, value = found.group(1), float(found.group(2))
    if name in PERCENT and not 0 < value <= 100:
        raise PlanError(f"invalid --metric {text!r}: {name} is in percent, above 0 and at most 100")
    if name in PERCENT and value < 1 and not found.group(3):
        raise PlanError(f"invalid --metric {text!r}: {name} is in percent: {name}={value * 100:g} for {value:.0%}")
    if "loss" in name and value < 0:
        raise PlanError(f"invalid --metric {text!r}: a loss is not negative")
    return name, value


def steps_to(curve: Sequence[tuple[int, dict[str, float]]], metric: str, target: float) -> tuple[int, str]:
    """The first evaluated step that reached the target (a loss: at or below it), with its model;
    PlanError when the curve never did (not extrapolated)."""
    lower = "loss" in metric
    seen = [(step, values[metric]) for step, values in curve if metric in values]
    if not seen:
        raise PlanError(f"the run's eval curve has no {metric!r} (it has: {_names(curve)})")
    for step, value in seen:
        if (value <= target) if lower else (value >= target):
            return (
                step,
                f"{metric} {value:g} at step {step}, the first of {len(seen)} evaluation(s) to reach {target:g}",
            )
    best = (min if lower else max)(seen, key=lambda sv: sv[1])
    raise PlanError(
        f"the run never reached {metric} {target:g} (best {best[1]:g} at step {best[0]} of {seen[-1][0]}): "
        "not extrapolated; train longer, then plan from that run"
    )


def _names(curve) -> str:
    return ", ".join(sorted({name for _, values in curve for name in values})) or "no evaluations"


@dataclass(frozen=True)
class Intervals:
    """How often a run keeps its state (train.config's defaults unless the base run's config.json says)."""

    snapshot_s: float = 60.0  # --snapshot-seconds, 0: off
    checkpoint_every: Optional[int] = None  # --checkpoint-every (steps)
    checkpoint_min: float = 30.0  # --checkpoint-minutes, 0: steps only

    def checkpoint_s(self, step_s: Optional[float]) -> Optional[float]:
        """The longest stretch between checkpoints: the step bound or the time bound, the sooner."""
        bounds = [self.checkpoint_min * 60] if self.checkpoint_min > 0 else []
        if self.checkpoint_every and step_s:
            bounds.append(self.checkpoint_every * step_s)
        return min(bounds) if bounds else None


def node_loss(estimate: Estimate, intervals: Intervals) -> str:
    """What a lost node costs at most on this plan, in recomputed steps (every node of the restart redoes
    them): the snapshot interval while a survivor holds one, else the checkpoint interval."""
    rate = estimate.usd_nodes / estimate.hours if estimate.usd_nodes is not None and estimate.hours else None
    checkpoint = intervals.checkpoint_s(estimate.step_s)

    def cost(seconds: Optional[float]) -> str:
        if seconds is None:
            return "the whole run (no checkpoint interval)"
        return f"{_duration(seconds)} of steps, {_usd(rate * seconds / 3600 if rate is not None else None)}"

    lost = f"a lost node (--max-restarts): at most {cost(intervals.snapshot_s or checkpoint)}"
    if intervals.snapshot_s > 0:
        return lost + f" (the snapshot interval); with every node's memory lost: {cost(checkpoint)} (checkpoints)"
    return lost + " (the checkpoint interval: --snapshot-seconds 0)"


def _duration(seconds: float) -> str:
    return (
        f"{seconds:g} s"
        if seconds < 120
        else f"{seconds / 60:.0f} min"
        if seconds < 7200
        else f"{seconds / 3600:.1f} h"
    )


def _usd(value: Optional[float], digits: int = 2) -> str:
    return "unknown" if value is None else f"${value:,.{digits}f}"


def _hours(hours: Optional[float]) -> str:
    if hours is None:
        return "?"
    return f"{hours * 60:.1f} min" if hours < 1 else f"{hours:.2f} h"


def table_rows(estimates: Sequence[Estimate], deadline_h: Optional[float]) -> list[dict]:
    """The rows `fab plan` prints: one per (type, N)."""
    rows = []
    for e in estimates:
        late = e.hours is not None and deadline_h is not None and e.hours > deadline_h
        rows.append(
            {
                "type": e.instance_type,
                "nodes": e.nodes,
                "step_ms": f"{e.step_s * 1e3:.0f}" if e.step_s else "",
                "time": _hours(e.hours) if e.hours is not None else "",
                "nodes $": _usd(e.usd_nodes) if e.step_s else "",
                "storage $": _usd(e.usd_storage) if e.step_s else "",
                "EFS I/O $": _usd(e.usd_io) if e.step_s else "",
                "total $": _usd(e.usd_total) if e.step_s else "",
                "deadline": ("late" if late else "ok") if deadline_h is not None and e.hours is not None else "",
                "note": e.refused,
            }
        )
    return rows


def with_spot(offer: Offer, usd_per_hour: Optional[float], source: str) -> Offer:
    return replace(offer, usd_per_hour=usd_per_hour, price_source=source)
