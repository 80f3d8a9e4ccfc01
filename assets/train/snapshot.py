"""The training state written without stopping the loop (issue 30). The training thread only copies the
state into host buffers (on a GPU a device-to-host copy on a side stream, on CPU a host copy); one
background thread serialises that copy and writes it, atomically (temp file beside the target, fsync,
os.replace). One set of host buffers, reused: a copy waits while the previous one is still being written
(that wait is the loop's stall too), so a process holds at most one copy of the state besides its own.
The buffers are views of one block of host memory per dtype (HostBlock), pageable unless the writer is
asked to page-lock them (one call or two for the whole state, not one per tensor)."""

from __future__ import annotations

import copy
import mmap
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from cluster_node.protocol import rundir


class _Slot:
    """A tensor's place in a state's template (its index in the flat list)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def flatten(state: Any, tensors: list[torch.Tensor], seen: Optional[dict] = None) -> Any:
    """The state's template: every tensor replaced by its _Slot (appended to `tensors`; one slot for two
    views of the same memory, as torch.save keeps tied weights once), every other leaf copied (the config,
    param groups, the scheduler: small, and the loop changes them after the copy)."""
    seen = {} if seen is None else seen
    if isinstance(state, torch.Tensor):
        key = (state.data_ptr(), state.device, state.dtype, tuple(state.shape), state.stride())
        if key not in seen:
            tensors.append(state.detach())
            seen[key] = _Slot(len(tensors) - 1)
        return seen[key]
    if isinstance(state, dict):
        return {key: flatten(value, tensors, seen) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        items = [flatten(value, tensors, seen) for value in state]
        return items if isinstance(state, list) else tuple(items)
    return copy.deepcopy(state)


def rebuild(template: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(template, _Slot):
        return tensors[template.index]
    if isinstance(template, dict):
        return {key: rebuild(value, tensors) for key, value in template.items()}
    if isinstance(template, (list, tuple)):
        items = [rebuild(value, tensors) for value in template]
        return items if isinstance(template, list) else tuple(items)
    return template


def owned(state: Any) -> Any:
    """`state` with each tensor that views a larger storage (a block of HostBlock's, loaded) copied into its
    own, so holding it holds no more than itself."""
    tensors: list[torch.Tensor] = []
    template = flatten(state, tensors)
    return rebuild(
        template, [t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t for t in tensors]
    )


def nbytes(state: Any) -> int:
    tensors: list[torch.Tensor] = []
    flatten(state, tensors)
    return sum(t.numel() * t.element_size() for t in tensors)


ALIGN = 64  # bytes: each buffer starts on a cache line
PAGE = mmap.PAGESIZE


def layout(specs: list) -> tuple[list[int], dict[torch.dtype, int]]:
    """Each (shape, dtype)'s element offset in its dtype's block, and each block's length in elements."""
    offsets: list[int] = []
    ends: dict[torch.dtype, int] = {}
    for shape, dtype in specs:
        step = max(1, ALIGN // dtype.itemsize)
        start = -(-ends.get(dtype, 0) // step) * step
        offsets.append(start)
        ends[dtype] = start + torch.Size(shape).numel()
    return offsets, ends


class HostBlock:
    """The writer's host buffers: one block of pageable memory per dtype (torch.save refuses one storage
    viewed as two dtypes), touched, carved into one view per tensor. With lock=True (a GPU) each block is
    then page-locked by one cudaHostRegister, so the copies into it are asynchronous. Not torch's pinned
    allocator: it makes one page-locked allocation per tensor (~740 for transformer-base with Adam),
    rounds each up to a power of two, and the CUDA guide counts every such allocation among the
    operations that serialise the device's streams (its "Implicit Synchronization")."""

    def __init__(self, specs: list, lock: bool):
        offsets, ends = layout(specs)
        self.blocks = {dtype: _paged(end, dtype) for dtype, end in ends.items()}
        self.views = [
            self.blocks[dtype][start : start + torch.Size(shape).numel()].view(shape)
            for (shape, dtype), start in zip(specs, offsets)
        ]
        self.locked = [block for block in self.blocks.values() if lock and block.numel() and _register(block)]

    def release(self) -> None:
        """Unlock the pages before the blocks are freed (the driver must not hold freed memory)."""
        while self.locked:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.locked.pop().data_ptr()))


def _paged(count: int, dtype: torch.dtype) -> torch.Tensor:
    """`count` elements of zeros (touched here, on the writer's thread, not at the first copy) in whole pages
    of their own: the driver page-locks whole pages, and a second block on a page the first one locked is
    refused (cudaErrorHostMemoryAlreadyRegistered), which small blocks from the heap would share."""
    size = -(-count * dtype.itemsize // PAGE) * PAGE
    raw = torch.zeros(size + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    return raw[start : start + size].view(dtype)[:count]


def _register(block: torch.Tensor) -> bool:
    """Page-lock one block's pages in one call; a refusal is one line and its copies stay synchronous."""
    size = -(-block.numel() * block.element_size() // PAGE) * PAGE
    try:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), size, 0))
        return True
    except Exception as error:  # torch.cuda.CudaError; any refusal leaves a correct, slower copy
        print(f"warning: snapshot buffers not page-locked ({error}); each copy waits for the GPU", flush=True)
        return False


class StateWriter:
    """submit(state, writes): copy now, write on the writer thread. At most one write in flight
    and no queue: the next submit waits for it. A write's error is raised on the training thread, at the
    next submit or flush (a failed checkpoint still ends the run, as a synchronous one did)."""

    def __init__(self, device: torch.device, lock: bool = False):
        """lock: page-lock the host buffers on a GPU (its copies then return at once). Off: on an H100 the
        trainer holding its ~579 MB state page-locked ran 1.28x (1.23x pinned per tensor) the plain loop on
        the same steps, 1.05x holding none (session 23, docs/measured.md); into pageable memory a
        snapshot's copy took 0.059 s against 0.012, once a snapshot interval (60 s)."""
        self.device = device
        self.lock = lock and device.type == "cuda"
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="state-writer")
        self.pending: Optional[Future] = None
        self.host = HostBlock([], lock=False)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def flush(self) -> None:
        """Wait for the write in flight (its file is durable when this returns)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def reserve(self, state: Any) -> None:
        """Allocate (and touch) the host buffers for a state of this shape on the writer thread, ahead of the
        first copy: the first touch of 727 MB of fresh pages costs ~1 s, a copy into touched ones ~0.1 s."""
        self.flush()
        tensors: list[torch.Tensor] = []
        flatten(state, tensors)
        specs = [(t.shape, t.dtype) for t in tensors]
        self.pending = self.pool.submit(self._allocate, specs)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self.host.views

    def _allocate(self, specs: list) -> None:
        self.host.release()
        self.host = HostBlock(specs, lock=self.lock)

    def submit(self, state: Any, writes: list[Callable[[Any, float], None]]) -> float:
        """Copies `state`; each write(host_state, stalled_s) runs in turn on the writer thread. Returns the
        seconds the caller stalled: the wait for the previous write plus the copy."""
        began = time.perf_counter()
        self.flush()
        tensors: list[torch.Tensor] = []
        template = flatten(state, tensors)
        if [(b.shape, b.dtype) for b in self.buffers] != [(t.shape, t.dtype) for t in tensors]:
            self._allocate([(t.shape, t.dtype) for t in tensors])  # a new shape (the optimizer's first state)
        ready = self._copy(tensors)
        host = rebuild(template, self.buffers)
        stalled = time.perf_counter() - began
        self.pending = self.pool.submit(_write_when_ready, ready, host, writes, stalled)
        return stalled

    def _copy(self, tensors: list[torch.Tensor]) -> Optional[torch.cuda.Event]:
        if self.stream is None:
            for buffer, tensor in zip(self.buffers, tensors):
                buffer.copy_(tensor)
            return None
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)  # the copy sees the step's results
        with torch.cuda.stream(self.stream):
            for buffer, tensor in zip(self.buffers, tensors):
                buffer.copy_(tensor, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(self.stream)
        main.wait_stream(self.stream)  # the next step's in-place updates wait for the copy, on the GPU only
        return ready

    def close(self) -> None:
        self.flush()
        self.pool.shutdown(wait=True)
        self.host.release()


def _write_when_ready(ready: Optional[torch.cuda.Event], host: Any, writes: list, stalled: float) -> None:
    if ready is not None:
        ready.synchronize()
    for write in writes:
        write(host, stalled)


# ---------------------------------------------------------------- the node's snapshot (/dev/shm)


def snapshot_dir(run_dir: str | os.PathLike, env: Mapping[str, str] | None = None) -> Path:
    """Where this node keeps its snapshot of the run: SNAPSHOT_ROOT (or $GPU_CLUSTER_SNAPSHOT_DIR, one per
    emulated node, which share a machine)/RUN/, one snapshot_STEP.pt in it."""
    return rundir.snapshot_root(env) / Path(run_dir).resolve().name


def available_bytes(directory: Path) -> tuple[int, int]:
    """(MemAvailable, free bytes where the snapshot goes): /dev/shm is RAM, and its limit is its own."""
    memory = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                memory = int(line.split()[1]) * 1024
    except OSError:
        memory = 0
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    stat = os.statvfs(probe)
    return memory, stat.f_bavail * stat.f_frsize


def memory_refusal(size: int, directory: Path) -> Optional[str]:
    """None when the node holds a snapshot: the host copy (1x), the file (1x) and the one being written
    (1x) at the peak; else the one line that says why snapshots are off on this node."""
    memory, shm = available_bytes(directory)
    mb = size / 1e6
    if memory and 3 * size > memory:
        return (
            f"snapshots off on this node: one takes {mb:.0f} MB, {3 * mb:.0f} MB while one is written, "
            f"but {memory / 1e6:.0f} MB of memory is available (--snapshot-seconds 0 turns them off)"
        )
    if 2 * size > shm:
        return (
            f"snapshots off on this node: {directory} has {shm / 1e6:.0f} MB free, a snapshot needs "
            f"{2 * mb:.0f} MB while the next one is written (--snapshot-seconds 0 turns them off)"
        )
    return None
