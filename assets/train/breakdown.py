"""Where each training step's time goes, and the bytes its gradient all-reduce puts on the wire.

A step is marked at: start, data loaded, first forward, last comm-hook call (DDP calls the hook as
each bucket's gradients are ready: the last call ends the compute that can hide communication),
backward returned (DDP waits for every bucket's future there), optimizer done, end. Then
    data = loaded - start; compute = last hook - forward (backward end if no hook ran);
    comm_exposed = backward end - last hook; optimizer = done - backward end; other = the rest,
so the parts sum to the step exactly. CPU marks are wall-clock; CUDA marks are events on the
current stream, resolved once per logging interval (no host sync per step).
"""

from __future__ import annotations

import resource
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from train.stepmodel import ring_wire_bytes  # noqa: F401 - the step model's, for trainer.py's wire bytes

PARTS = ("data_s", "compute_s", "comm_exposed_s", "optimizer_s", "other_s")


class WallClock:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return end - start

    def wait(self, marker: Any) -> None:
        pass


class CudaClock:
    """torch.cuda.Event marks (an injectable factory, so the bookkeeping is testable without a GPU)."""

    def __init__(self, event_factory: Callable[[], Any] | None = None):
        self.event_factory = event_factory or (lambda: torch.cuda.Event(enable_timing=True))

    def mark(self) -> Any:
        event = self.event_factory()
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0

    def wait(self, marker: Any) -> None:
        marker.synchronize()


def clock_for(device: torch.device) -> WallClock | CudaClock:
    return CudaClock() if device.type == "cuda" else WallClock()


def step_parts(marks: dict, seconds: Callable[[Any, Any], float]) -> dict:
    """One step's parts (PARTS plus step_s) from its marks."""
    compute_end = marks.get("last_hook", marks["backward"])
    parts = {
        "data_s": seconds(marks["start"], marks["data"]),
        "compute_s": seconds(marks["forward"], compute_end),
        "comm_exposed_s": seconds(compute_end, marks["backward"]),
        "optimizer_s": seconds(marks["backward"], marks["optimizer"]),
        "step_s": seconds(marks["start"], marks["end"]),
        "payload_bytes": marks.get("payload_bytes", 0),
        "buckets": marks.get("hooks", 0),
        **({"flops": marks["flops"]} if "flops" in marks else {}),  # the trainer's (perf.py)
    }
    parts["other_s"] = parts["step_s"] - sum(parts[k] for k in PARTS if k != "other_s")
    return parts


class StepTimer:
    """Marks per step; `resolve` turns the pending steps into parts (once per logging interval)."""

    def __init__(self, clock: WallClock | CudaClock):
        self.clock = clock
        self.current: dict = {}
        self.pending: list[dict] = []

    def begin(self) -> None:
        self.current = {"start": self.clock.mark()}

    def mark(self, name: str) -> None:
        self.current[name] = self.clock.mark()

    def end(self) -> None:
        self.mark("end")
        self.pending.append(self.current)
        self.current = {}

    def resolve(self) -> list[dict]:
        if not self.pending:
            return []
        self.clock.wait(self.pending[-1]["end"])
        parts = [step_parts(marks, self.clock.seconds) for marks in self.pending]
        self.pending = []
        return parts


class AllReduceCounter:
    """Bytes of every tensor handed to torch.distributed.all_reduce while armed (around the step's
    synchronising backward), whoever calls it: the default, fp16/bf16 and PowerSGD hooks (its P, Q
    and uncompressed tensors, some sent from future callbacks on another thread) all call it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed = False
        self.bytes = 0

    def install(self) -> None:
        original = dist.all_reduce

        def counting_all_reduce(tensor, *args, **kwargs):
            if self.armed:
                with self.lock:
                    self.bytes += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce  # type: ignore[assignment]

    def take(self) -> int:
        with self.lock:
            counted, self.bytes = self.bytes, 0
        return counted


def timed_hook(hook: Callable, timer: StepTimer) -> Callable:
    """`hook`, marking the time of each call (the last call's mark ends the step's compute)."""

    def wrapper(state, bucket):
        timer.mark("last_hook")
        timer.current["hooks"] = timer.current.get("hooks", 0) + 1
        return hook(state, bucket)

    return wrapper


def mean_parts(steps: list[dict]) -> dict:
    keys = [*PARTS, "step_s", "payload_bytes", "buckets", *(["flops"] if steps and "flops" in steps[0] else [])]
    return {k: sum(s.get(k, 0.0) for s in steps) / len(steps) for k in keys} if steps else {}


def critical_rank(per_rank: list[dict]) -> int:
    """The rank the others wait for: the most data wait plus compute per step. Its exposed
    communication is the network's; a faster rank's also holds the wait for this one (on shared or
    uneven CPUs, enough to call a compute-bound run mixed)."""
    return max(range(len(per_rank)), key=lambda r: per_rank[r].get("data_s", 0.0) + per_rank[r].get("compute_s", 0.0))


def memory_mb(device: torch.device) -> float:
    """Peak memory: the GPU's allocations, or the process's resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parts_line(parts: dict) -> str:
    """data 1 | compute 300 | comm 50 | opt 20 | other 5 ms"""
    names = {
        "data_s": "data",
        "compute_s": "compute",
        "comm_exposed_s": "comm",
        "optimizer_s": "opt",
        "other_s": "other",
    }
    return " ".join(f"{name} {parts.get(key, 0.0) * 1000:.0f}" for key, name in names.items()) + " ms"
