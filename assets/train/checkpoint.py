"""Checkpoints in RUN_DIR/checkpoints: written by global rank 0 only, atomically (temp file, fsync,
rename), in the background (train.snapshot.StateWriter runs persist()); the last K kept plus best.pt; the
newest loadable one is resumed, corrupt ones skipped, unless every rank holds a newer snapshot of the run
in its node's memory (persist_snapshot, load_agreed)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Optional

import torch

from cluster_node.protocol import rundir
from train.data import atomic_write_bytes


class CheckpointUnreadable(OSError):
    """The checkpoint rank 0 chose could not be read on this rank: an I/O fault a relaunch may not meet."""


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / rundir.CHECKPOINTS


def _is_step(name: str) -> bool:
    """A step checkpoint's name (rundir.CHECKPOINT), not best.pt nor a writer's temp file."""
    digits = re.sub(r"\D", "", name)
    return bool(digits) and name == rundir.CHECKPOINT.format(step=int(digits))


def save(run_dir: str | os.PathLike, step: int, state: dict, keep: int, best: bool = False) -> Path:
    directory = checkpoint_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = rundir.checkpoint(Path(run_dir), step)
    atomic_write_bytes(path, lambda f: torch.save(state, f))
    if best:
        atomic_write_bytes(directory / rundir.BEST_CHECKPOINT, lambda f: f.write(path.read_bytes()))
    for old in list_steps(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    for stale in directory.glob(".*.tmp.*"):  # left by a writer that was killed mid-write
        stale.unlink(missing_ok=True)
    return path


def persist(run_dir: str | os.PathLike, step: int, keep: int, best: bool, log=print):
    """The write StateWriter runs for a checkpoint: save(), then the `checkpoint` line (after its rename:
    a line in train.log names a durable file)."""

    def write(state: dict, stalled: float) -> None:
        began = time.perf_counter()
        path = save(run_dir, step, state, keep, best=best)
        took = time.perf_counter() - began
        log(
            f"checkpoint {path} ({size_mb(path):.1f} MB in {took:.2f} s) in the background; "
            f"the loop waited {stalled:.3f} s"
        )

    return write


def persist_snapshot(directory: Path, run_dir: str | os.PathLike, step: int, log=print):
    """The write StateWriter runs for this node's snapshot: DIRECTORY/snapshot_STEP.pt, atomically; then the
    older ones go (the node holds one; a write in flight is a temp file) and so does a killed writer's temp
    file (RAM, on /dev/shm). A write that fails (/dev/shm full: DataLoader workers share it) is one line
    and the run goes on: the older snapshot and the checkpoints remain."""

    def write(state: dict, stalled: float) -> None:
        path = directory / rundir.SNAPSHOT.format(step=step)
        marked = {**state, "run_dir": str(Path(run_dir).resolve())}
        try:
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, lambda f: torch.save(marked, f))
        except (OSError, RuntimeError) as error:  # torch.save reports a short write as a RuntimeError
            log(f"warning: snapshot at step {step} not written ({type(error).__name__}: {error}); the older one stays")
            return
        for older in directory.glob(rundir.SNAPSHOT_GLOB):
            if older != path:
                older.unlink(missing_ok=True)
        remove_stale(path)

    return write


def drop_snapshots(directory: Optional[Path]) -> None:
    """The end of a run that wrote its final checkpoint: this node's snapshots of it hold nothing newer,
    and they take the node's RAM (the run directory's own folder goes when empty)."""
    if directory is None:
        return
    for held in directory.glob(rundir.SNAPSHOT_GLOB):
        held.unlink(missing_ok=True)
    try:
        directory.rmdir()
    except OSError:  # not empty (a writer's temp file of a live process) or gone
        pass


def remove_stale(path: Path) -> None:
    """Temp files of `path`'s kind (snapshot_*.pt's) beside it, left by a writer killed mid-write: their
    process is gone (emulated nodes share /dev/shm when GPU_CLUSTER_SNAPSHOT_DIR is unset: another's live
    write is left alone)."""
    for stale in path.parent.glob(f".{path.name.split('_')[0]}*.tmp.*"):
        pid = stale.name.rsplit(".", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        stale.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_steps(run_dir: str | os.PathLike) -> list[Path]:
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _is_step(p.name))


def load_latest(run_dir: str | os.PathLike, log=print) -> Optional[dict]:
    """The newest checkpoint that loads; corrupt or truncated ones are reported and skipped."""
    for path in reversed(list_steps(run_dir)):
        state = _load_checked(path, log)
        if state is not None:
            return state
    return None


def _load_checked(path: Path, log) -> Optional[dict]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
        if not isinstance(state, dict) or "step" not in state or "model" not in state:
            raise ValueError("not a training checkpoint")
    except Exception as error:  # noqa: BLE001 - any unreadable file is skipped the same way
        log(f"skipping unreadable checkpoint {path.name}: {type(error).__name__}: {error}")
        return None
    state["path"] = str(path)
    return state


def load_agreed(
    run_dir: str | os.PathLike,
    is_main: bool,
    broadcast,
    log=print,
    snapshot: Optional[Path] = None,
    gather=None,
) -> Optional[dict]:
    """Rank 0 picks the newest loadable checkpoint and `broadcast`s its path; every other rank loads
    that exact file. Ranks never choose on their own: on NFS each one's listing can lag.
    With `snapshot` (this node's snapshot directory; every rank passes one or none) and `gather` (every
    rank's value): a snapshot as new as that checkpoint or newer wins when every rank holds one at the same
    step (each loads its node's RAM, not /data); a snapshot on some nodes only, or at different steps, is
    not used (the supervisor copies the newest one a survivor holds to /data for that restart)."""
    held = load_snapshot(snapshot, run_dir, log) if snapshot is not None else None
    steps = gather(held["step"] if held else None) if snapshot is not None and gather else [None]
    state, choice = _choose(run_dir, steps, log) if is_main else (None, None)
    choice = broadcast(choice)
    if choice is None:
        return None
    if "snapshot" in choice:
        if held is None or held["step"] != choice["snapshot"]:  # rank 0 saw every rank's step: a bug
            raise FileNotFoundError(f"snapshot at step {choice['snapshot']} is not held here ({snapshot})")
        return held
    if is_main:
        return state
    path = choice["path"]
    try:
        state = load_file(path)
    except OSError as error:  # EIO, ESTALE, an EFS timeout: not "no data set" (exit 2), so a restart retries
        raise CheckpointUnreadable(f"checkpoint {path}, chosen by rank 0, is not readable here: {error}") from None
    state["path"] = path
    return state


def agreed_step(steps: list) -> Optional[int]:
    """The step every rank's snapshot holds, or None (one rank without, or two steps)."""
    return steps[0] if steps and None not in steps and len(set(steps)) == 1 else None


def _choose(run_dir: str | os.PathLike, steps: list, log) -> tuple[Optional[dict], Optional[dict]]:
    """Rank 0: (the checkpoint's state or None, the choice to broadcast). Checkpoints no newer than the agreed
    snapshot are not even read (727 MB each, from EFS). A snapshot only resumes a run that has config.json:
    a new run under an old name never resumes its namesake's snapshot."""
    agreed = agreed_step(steps)
    if agreed is not None and not (Path(run_dir) / rundir.CONFIG).exists():
        agreed = None
    for path in reversed(list_steps(run_dir)):
        step = rundir.checkpoint_step(path)
        if agreed is not None and step is not None and agreed >= step:
            break
        state = _load_checked(path, log)
        if state is not None:
            return state, {"path": state["path"]}
    return None, ({"snapshot": agreed} if agreed is not None else None)


def load_snapshot(directory: Path, run_dir: str | os.PathLike, log=print) -> Optional[dict]:
    """This node's newest snapshot of this run, or None: absent, unreadable (a writer killed before its
    rename leaves only its temp file; this is for anything else) or another run directory's."""
    held = sorted(directory.glob(rundir.SNAPSHOT_GLOB), key=lambda p: rundir.snapshot_step(p) or -1)
    for path in reversed(held):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)  # tmpfs: no copy until used
            if not isinstance(state, dict) or "step" not in state or "model" not in state:
                raise ValueError("not a training snapshot")
        except Exception as error:  # noqa: BLE001 - any unreadable file is skipped the same way
            log(f"skipping unreadable snapshot {path}: {type(error).__name__}: {error}")
            continue
        if state.get("run_dir") != str(Path(run_dir).resolve()):
            log(f"ignoring snapshot {path}: it is {state.get('run_dir')}'s")
            return None
        state["path"] = str(path)
        return state
    return None


def load_file(path: str | os.PathLike) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def size_mb(path: str | os.PathLike) -> float:
    return os.path.getsize(path) / 1e6


def settle_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state as its fused kernels need it, after it is made or loaded. Each tensor shaped like
    its parameter gets the parameter's memory layout: a checkpoint's tensors come back row-major (the state
    writer's host buffers), a ResNet's weights are channels-last, and CUDA's fused SGD and Adam refuse tensors
    whose strides differ. SGD's momentum buffers exist from the start, as zeros (the same first step,
    dampening 0): torch's fused SGD made a first step's with empty_like and kept them when GradScaler skipped
    that step for an inf (fp16's first steps often overflow): NaN parameters from the next step on."""
    for group in optimizer.param_groups:
        momentum = isinstance(optimizer, torch.optim.SGD) and group.get("momentum", 0) > 0
        for param in group["params"]:
            state = optimizer.state[param]
            for key, value in list(state.items()):
                if torch.is_tensor(value) and value.shape == param.shape and value.stride() != param.stride():
                    state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)
            if momentum and state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(param)
