"""DDP communication hooks for --grad-compression: fp16/bf16 all-reduce, PowerSGD (serialized on gloo),
or a plain all-reduce, each timed for the step breakdown."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from train import breakdown
from train.config import TrainConfig


def compress_hook(dtype: torch.dtype):
    """A DDP comm hook that all-reduces gradients in `dtype` (fp16/bf16), on NCCL and on gloo
    (PyTorch's own bf16 hook insists on NCCL)."""
    import torch.distributed as dist

    def hook(state, bucket):
        buffer = bucket.buffer()
        # Divided in fp32 first: a gradient between fp16's largest value and world size times it overflows the cast.
        compressed = buffer.div_(dist.get_world_size()).to(dtype)
        future = dist.all_reduce(compressed, async_op=True).get_future()

        def decompress(fut):
            buffer.copy_(fut.value()[0])
            return buffer

        return future.then(decompress)

    return hook


def serialized_hook(hook):
    """`hook` with each bucket's collectives started only once the previous bucket's have finished.
    PowerSGD all-reduces its P and Q from future callbacks and waits there: with two buckets in flight
    on gloo, the ranks hang at the first compressed step (what forced one bucket, pytorch#58467).
    Chained, every rank issues the same collectives in the same order, and buckets still overlap the
    rest of the backward pass."""
    tail: list = [None]

    def serialized(state, bucket):
        previous = tail[0]
        if previous is None:
            future = hook(state, bucket)
        else:
            future = torch.futures.Future()

            def finish(done):
                try:
                    future.set_result(done.wait())
                except Exception as error:  # noqa: BLE001 - handed to DDP through the future
                    future.set_exception(error)

            def start(done):
                try:
                    done.wait()
                    hook(state, bucket).then(finish)
                except Exception as error:  # noqa: BLE001
                    future.set_exception(error)

            previous.then(start)
        tail[0] = None if bucket.is_last() else future
        return future

    return serialized


def recovering_hook(hook):
    """PowerSGD (`hook`) that recovers from a step whose gradients overflowed. fp16's loss scaling makes such
    steps on purpose (GradScaler skips them and lowers the scale), and PowerSGD's error feedback and its
    warm-started Q carried the inf into every later step: gradients non-finite for good, every step
    skipped (torch 2.6 and later). A bucket whose error came out non-finite gets a zero error and a fresh
    Q, the same on every rank (a generator seeded by the bucket's index), and Q's zero entries are fresh
    too: on the device, no host read."""
    fresh: dict[int, torch.Tensor] = {}

    def recovering(state, bucket):
        index = bucket.index()

        def clean(fut):
            error, q = state.error_dict.get(index), state.q_memory_dict.get(index)
            if error is not None:
                bad = ~torch.isfinite(error).all()
                error.masked_fill_(bad, 0.0)
                if q is not None:
                    if index not in fresh:
                        seeded = torch.Generator(q.device).manual_seed(index)
                        fresh[index] = torch.randn(q.shape, generator=seeded, device=q.device, dtype=q.dtype)
                    # And Q's zero entries: an all-zero gradient matrix makes its Q zero (P = MQ = 0, normalised
                    # to 0 with the epsilon), and a zero Q gives P = 0 for good, whatever the next gradients.
                    q.copy_(torch.where(bad | (q == 0), fresh[index], q))
            return fut.value()

        return hook(state, bucket).then(clean)

    return recovering


# Added to each normalised column in PowerSGD's Gram-Schmidt (rank <= 2): an all-zero gradient matrix (a ResNet
# block's last conv while its zero-initialised BN scale is still 0, e.g. after GradScaler skipped the first
# steps) is 0/0 there; PyTorch's docs suggest 1e-8 where batch norm does not prevent it.
ORTHOGONALIZATION_EPSILON = 1e-8


def powersgd_state(rank: int):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    return powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=2,
        use_error_feedback=True,
        warm_start=True,
        orthogonalization_epsilon=ORTHOGONALIZATION_EPSILON,
    )


def register(ddp: DDP, config: TrainConfig, timer: breakdown.StepTimer) -> None:
    """The mode's hook (a Python all-reduce hook for none), timed for the step breakdown."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if config.grad_compression in ("fp16", "bf16"):
        dtype = torch.float16 if config.grad_compression == "fp16" else torch.bfloat16
        ddp.register_comm_hook(None, breakdown.timed_hook(compress_hook(dtype), timer))
    elif config.grad_compression == "powersgd":
        state = powersgd_state(config.powersgd_rank)
        hook = recovering_hook(powerSGD_hook.powerSGD_hook)
        if dist.get_backend() == "gloo":
            hook = serialized_hook(hook)
        ddp.register_comm_hook(state, breakdown.timed_hook(hook, timer))
    else:
        ddp.register_comm_hook(None, breakdown.timed_hook(default_hooks.allreduce_hook, timer))
