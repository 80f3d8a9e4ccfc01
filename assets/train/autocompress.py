"""`--grad-compression auto`: the mode the step-time model (stepmodel.py, the one `fab report` uses)
predicts fastest, from a short measurement at the start of the run.

choose() is pure. The measurements (torch) are below it: `calibrate` times each mode's own local
work on this model's gradient shapes (every multi-node run records it, so `fab report` can predict
the modes it did not run); `probe` times a forward+backward without synchronisation and an
all-reduce of the gradient's size, which gives the link rate as the all-reduce sees it.
"""

from __future__ import annotations

import time
from typing import Optional

from train import stepmodel

MARGIN = 0.05  # leave plain fp32 gradients only for a predicted gain above the measurement's noise
CHOICES = ("none", "fp16", "bf16", "powersgd")


def choose(b: stepmodel.Breakdown, link_gbit: float) -> tuple[str, str, dict]:
    """(mode, why, predicted step seconds per mode) for the measured breakdown `b` of plain DDP."""
    predicted = {}
    for mode in CHOICES:
        prediction = stepmodel.compression_what_if(b, link_gbit, mode)
        if prediction is not None:
            predicted[mode] = prediction.step_s
    best = min(predicted, key=lambda mode: (predicted[mode], CHOICES.index(mode)))
    if best != "none" and predicted[best] > predicted["none"] * (1 - MARGIN):
        best = "none"
    comm = stepmodel.comm_seconds(b, link_gbit)
    why = (
        f"compute {b.compute * 1000:.0f} ms, all-reduce of {b.grad_bytes / 1e6:.1f} MB {comm * 1000:.0f} ms "
        f"({link_gbit:.2f} Gbit/s); predicted "
        + ", ".join(f"{mode} {seconds * 1000:.0f} ms" for mode, seconds in predicted.items())
        + ("" if best != "none" else f" (a mode must win by {MARGIN:.0%} to replace none)")
    )
    return best, why, predicted


def _timed(work, repeats: int = 3, sync=lambda: None) -> float:
    """The fastest of `repeats` runs of work() (the first warms up caches), in seconds; sync() waits
    for the device's queue (GPU work is asynchronous)."""
    best = float("inf")
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        work()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def _sync(device):
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def calibrate(parameters, powersgd_rank: int, world_size: int, device=None, powersgd_single_bucket=False) -> dict:
    """Each compression mode's local work on gradients of these parameters' shapes, and PowerSGD's
    wire bytes: what `fab report` needs to predict a mode the run did not use."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    from train.commhooks import ORTHOGONALIZATION_EPSILON

    device = device or torch.device("cpu")
    shapes = [tuple(p.shape) for p in parameters if p.requires_grad]
    grads = [torch.randn(shape, device=device) for shape in shapes]
    flat = torch.cat([g.flatten() for g in grads])

    def cast(dtype):
        return lambda: flat.to(dtype).div_(world_size).to(torch.float32)

    matrices = []
    for grad in grads:
        n, m = (grad.shape[0], grad.numel() // grad.shape[0]) if grad.dim() >= 2 else (0, 0)
        rank = min(powersgd_rank, n, m)
        if grad.dim() >= 2 and (n + m) * rank * 2 < n * m:
            matrices.append((grad.view(1, n, m), torch.randn(1, m, rank, device=device), grad.new_empty(1, n, rank)))

    def powersgd():  # the hook's local work, as in powerSGD_hook: error feedback, Q, P = MQ, Q = M'P, M = PQ'
        kept = flat.add(0.0)
        for matrix, q, p in matrices:
            _orthogonalize(q, ORTHOGONALIZATION_EPSILON)  # as the hook does
            torch.bmm(matrix, q, out=p)
            _orthogonalize(p, ORTHOGONALIZATION_EPSILON)
            torch.bmm(matrix.transpose(1, 2), p, out=q)
            torch.bmm(p, q.transpose(1, 2), out=matrix)
        kept.sub_(flat)

    sync = _sync(device)  # a GPU's work is queued: without the wait each overhead was its launches alone
    return {
        "overhead_s": {
            "fp16": _timed(cast(torch.float16), sync=sync),
            "bf16": _timed(cast(torch.bfloat16), sync=sync),
            "powersgd": _timed(powersgd, sync=sync),
        },
        "powersgd_wire_bytes": stepmodel.powersgd_wire_bytes(shapes, powersgd_rank, world_size),
        "grad_bytes": 4 * flat.numel(),
        "powersgd_single_bucket": powersgd_single_bucket,
    }


def probe(forward_backward, grad_bytes: int, world_size: int, all_reduce, device=None) -> tuple[float, float]:
    """(compute seconds of one forward+backward, link Gbit/s as an all-reduce of the gradient's size
    sees it). `forward_backward()` must not synchronise gradients; all_reduce(tensor) is collective."""
    import torch

    device = device or torch.device("cpu")
    sync = _sync(device)
    compute = _timed(forward_backward, sync=sync)
    buffer = torch.zeros(grad_bytes // 4, device=device)
    seconds = _timed(lambda: all_reduce(buffer), repeats=2, sync=sync)
    wire = stepmodel.ring_wire_bytes(grad_bytes, world_size)
    return compute, (wire * 8 / seconds / 1e9) if seconds > 0 else float("inf")


def auto_breakdown(
    compute: float, link_gbit: float, calibration: dict, world_size: int, objects_per_step: float
) -> stepmodel.Breakdown:
    """Plain DDP's step as the probe sees it. Overlap is not measured before the first step: none is
    assumed (all communication exposed)."""
    wire = stepmodel.ring_wire_bytes(calibration["grad_bytes"], world_size)
    return stepmodel.Breakdown(
        data=0.0,
        compute=compute,
        exposed=wire * 8 / (link_gbit * 1e9),
        optimizer=0.0,
        other=0.0,
        wire_bytes=wire,
        grad_bytes=calibration["grad_bytes"],
        world_size=world_size,
        objects_per_step=objects_per_step,
        single_bucket=True,
        overheads=calibration["overhead_s"],
        powersgd_wire_bytes=calibration["powersgd_wire_bytes"],
        powersgd_single_bucket=calibration.get("powersgd_single_bucket", False),
    )


def start_of_run(trainer) -> tuple[dict, Optional[dict]]:
    """Before DDP is built, on every rank: the calibration (recorded in summary.json for `fab report`)
    and, with --grad-compression auto, rank 0's choice for all (config.grad_compression is set)."""
    import torch

    from train import distributed, perf

    c, info, model = trainer.config, trainer.info, trainer.model
    # PowerSGD runs in the same DDP buckets as plain gradients (the trainer's serialized_hook).
    calibration = calibrate(list(model.parameters()), c.powersgd_rank, info.world_size, trainer.device, False)
    if c.grad_compression != "auto":
        return calibration, None
    batches = trainer.task.batches(trainer.step)

    def forward_backward():
        amp = trainer.amp_dtype
        with torch.autocast(trainer.device.type, dtype=amp, enabled=amp is not None):
            for batch in batches:
                trainer.task.loss_sum(model, batch).backward()
        model.zero_grad(set_to_none=True)

    with perf.buffers_kept(model):  # BN statistics stay as they were
        compute, link_gbit = probe(
            forward_backward, calibration["grad_bytes"], info.world_size, distributed.all_reduce_sum, trainer.device
        )
    objects = c.global_batch(info.world_size)
    mode, why, predicted = choose(auto_breakdown(compute, link_gbit, calibration, info.world_size, objects), link_gbit)
    mode, why, predicted = distributed.broadcast_from_main((mode, why, predicted))
    c.grad_compression = mode
    return calibration, {"chosen": mode, "why": why, "predicted_step_s": predicted}
