"""Launch-agnostic process-group setup: OpenMPI (mpirun), torchrun, or a single process."""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def detect(env: Mapping[str, str] | None = None) -> DistInfo:
    """Rank, world size and local rank from OpenMPI's or torchrun's variables."""
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_RANK" in env:
        return DistInfo(
            int(env["OMPI_COMM_WORLD_RANK"]),
            int(env["OMPI_COMM_WORLD_SIZE"]),
            int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
            "mpirun",
        )
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    return DistInfo()


def backend_for(device: torch.device) -> str:
    """GPUs: NCCL for CUDA tensors (DDP, the trainer's counters) and gloo for CPU ones (the pickles of
    all_gather_object and broadcast_object_list); an NCCL-only group rejects any CPU tensor."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def device_for(info: DistInfo, env: Mapping[str, str] = os.environ) -> torch.device:
    """One GPU per local rank, or the CPU for a process given none. The NVIDIA container runtime gives a
    container its GPUs by NVIDIA_VISIBLE_DEVICES ("void", "none" or empty: none); a rank given GPUs whose
    torch finds no CUDA device (a driver older than the image's CUDA, a GPU lost) would train on the
    CPU over gloo, silently and many times slower: it stops instead, saying why."""
    if torch.cuda.is_available():
        if info.local_rank >= torch.cuda.device_count():  # two ranks on one GPU: NCCL fails them all, later
            raise SystemExit(
                f"error: rank {info.rank} is local rank {info.local_rank} but torch sees "
                f"{torch.cuda.device_count()} GPU(s): one rank per GPU (mpirun -H HOST:SLOTS, -c gpus_per_node)"
            )
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
        return device
    given = env.get("NVIDIA_VISIBLE_DEVICES", "")
    if given not in ("", "void", "none"):
        raise SystemExit(
            f"error: rank {info.rank} was given GPUs (NVIDIA_VISIBLE_DEVICES={given}) but torch "
            f"{torch.__version__} (CUDA {torch.version.cuda}) finds no CUDA device: not training on the CPU; "
            "`fab check` names the node (nvidia-smi, the driver against the image's CUDA)"
        )
    return torch.device("cpu")


def setup(timeout_s: float = 300.0) -> tuple[DistInfo, torch.device]:
    """Initialise the process group (see backend_for); one GPU per local rank."""
    info = detect()
    device = device_for(info)
    backend = backend_for(device)
    if os.environ.get("TRAIN_STRICT_DEVICE", "") not in ("", "0"):
        from train import strict_device

        strict_device.install(device)
    if info.world_size > 1:
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise SystemExit(
                    f"error: {key} is not set; the launcher must export it "
                    "(fab train does; by hand: mpirun -x MASTER_ADDR=HEAD_IP -x MASTER_PORT=29500)"
                )
        dist.init_process_group(
            backend, rank=info.rank, world_size=info.world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
    return info, device


def teardown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_without_finalizing(code: int) -> None:
    """End a rank whose output is written and process group torn down. A gloo worker thread can still
    be freeing a finished collective's Python tensors when the interpreter shuts down; unable to take
    the GIL it aborts the rank ("terminate called without an active exception", signal 6: seen in
    about half of the 2-node runs), and mpirun fails a finished run. So: flush, and no finalization."""
    import multiprocessing
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    for child in multiprocessing.active_children():  # DataLoader workers hold the rank's stdout open: mpirun
        child.terminate()  # waited ~5 s at the end of every resnet run (their parent check) for its EOF
    os._exit(code)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def start_all_reduce_sum(tensor: torch.Tensor):
    """An in-place sum started now; call the returned function before reading `tensor`."""
    if not dist.is_initialized():
        return lambda: None
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
    return work.wait


def broadcast_from_main(obj):
    """Rank 0's `obj`, on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(obj):
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """Host values as a float32 tensor on `device` without stalling its queue: on a GPU, copied from
    page-locked memory without blocking. (`tensor[i] = value` on a GPU copies a host scalar and waits
    for the stream, as `torch.tensor(values, device=...)` does: pytorch/pytorch#188267, #190217.)"""
    host = torch.tensor(values, dtype=torch.float32, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values on the host without stalling the device queue: on GPUs an async copy
    into pinned memory, waited for only when read. `local`: values the host already has (one process:
    no sum to wait for), read without waiting for the device at all."""

    def __init__(self, tensor: torch.Tensor, local: list | None = None):
        self.event, self.local = None, local
        if local is not None:
            return
        if tensor.is_cuda:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor

    def values(self) -> list:
        if self.local is not None:
            return self.local
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
