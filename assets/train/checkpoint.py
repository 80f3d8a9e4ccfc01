"""Checkpoints in RUN_DIR/checkpoints: written by global rank 0 only, atomically (temp file, fsync,
rename); the last K kept plus best.pt; the newest loadable one is resumed, corrupt ones skipped."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

import torch

from cluster_node.protocol import rundir
from train.data import atomic_write_bytes


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


def list_steps(run_dir: str | os.PathLike) -> list[Path]:
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _is_step(p.name))


def load_latest(run_dir: str | os.PathLike, log=print) -> Optional[dict]:
    """The newest checkpoint that loads; corrupt or truncated ones are reported and skipped."""
    for path in reversed(list_steps(run_dir)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
            if not isinstance(state, dict) or "step" not in state or "model" not in state:
                raise ValueError("not a training checkpoint")
        except Exception as error:  # noqa: BLE001 - any unreadable file is skipped the same way
            log(f"skipping unreadable checkpoint {path.name}: {type(error).__name__}: {error}")
            continue
        state["path"] = str(path)
        return state
    return None


def load_agreed(run_dir: str | os.PathLike, is_main: bool, broadcast, log=print) -> Optional[dict]:
    """Rank 0 picks the newest loadable checkpoint and `broadcast`s its path; every other rank loads
    that exact file. Ranks never choose on their own: on NFS each one's listing can lag."""
    state = load_latest(run_dir, log) if is_main else None
    path = broadcast(state["path"] if state else None)
    if is_main or path is None:
        return state
    try:
        state = load_file(path)
    except OSError as error:
        raise FileNotFoundError(f"checkpoint {path}, chosen by rank 0, is not readable here: {error}") from None
    state["path"] = path
    return state


def load_file(path: str | os.PathLike) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def size_mb(path: str | os.PathLike) -> float:
    return os.path.getsize(path) / 1e6
