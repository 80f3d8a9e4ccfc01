"""Strict-device mode (TRAIN_STRICT_DEVICE=1; the 2-rank tests turn it on): every tensor given to a
collective must be on the trainer's device, as NCCL demands on GPUs.

On a CPU-only machine every tensor is a CPU tensor, so `tensor.device` alone cannot catch a tensor
created without `device=` (which lands on the host on a GPU node). This mode tracks where tensors
come from instead: a factory call without a device (torch.tensor, zeros, ...) or `.cpu()` marks its
result as host-made, with the line that made it; an operation whose tensor inputs are all host-made
passes the mark on; `.to(device)` or `device=` gives an unmarked tensor. A collective given a marked
tensor, or one on another device, raises with that line."""

from __future__ import annotations

import functools
import os
import sys
from types import FrameType

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ENV = "TRAIN_STRICT_DEVICE"
_MARK = "_strict_device_made_at"
_FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.asarray,
    torch.from_numpy,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.eye,
    torch.scalar_tensor,
}
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)


def _caller() -> str:
    """The first frame outside torch and this module: where the tensor was made."""
    frame: FrameType | None = sys._getframe(2)
    while frame and (frame.f_code.co_filename == __file__ or f"{os.sep}torch{os.sep}" in frame.f_code.co_filename):
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame else "?"


def _tensors(values) -> list:
    """Tensors among the values, one list level deep (torch.stack([a, b]))."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            found += [v for v in value if isinstance(v, torch.Tensor)]
    return found


class _Tracker(TorchFunctionMode):
    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = _tensors(list(args) + list(kwargs.values()))
        if func is torch.Tensor.to:
            target = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
            if target is not None and target == self.device:
                return result.clone() if result is args[0] and hasattr(result, _MARK) else result
        mark = None
        if func is torch.Tensor.cpu or (func in _FACTORIES and kwargs.get("device") is None):
            mark = _caller()
        elif kwargs.get("device") is None and inputs and all(hasattr(t, _MARK) for t in inputs):
            mark = getattr(inputs[0], _MARK)
        if mark:
            for out in _tensors([result]):
                if all(out is not t for t in inputs):
                    setattr(out, _MARK, mark)
        return result


def check(name: str, tensors, device: torch.device) -> None:
    for tensor in _tensors(tensors):
        made_at = getattr(tensor, _MARK, None)
        if made_at or tensor.device != device:
            where = f"made on the host at {made_at}" if made_at else f"on {tensor.device}"
            raise RuntimeError(
                f"strict device: {name} got a tensor {where}, not on the trainer's device "
                f"{device} (NCCL rejects it on GPUs): create it with device="
            )


def _checked(name: str, collective, device: torch.device):
    @functools.wraps(collective)
    def wrapper(*args, **kwargs):
        check(name, list(args) + list(kwargs.values()), device)
        return collective(*args, **kwargs)

    return wrapper


def install(device: torch.device) -> None:
    """Track host-made tensors from now on and check every torch.distributed collective."""
    _Tracker(device).__enter__()
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _checked(name, getattr(dist, name), device))
