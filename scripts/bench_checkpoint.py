"""The training loop's stall per checkpoint, synchronous vs background (issue 30), for transformer-base
(model + Adam state, 727 MB) on CPU, in one process: the synchronous save the trainer did before
(torch.save, fsync, rename) and the copy the loop waits for now (train.snapshot.StateWriter; the write
runs on its thread). Also the node snapshot's write to memory (/dev/shm). Each figure is the best of
--repeats. Usage: python scripts/bench_checkpoint.py [--dir DIR] [--repeats 2] [--device cuda]"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from train import checkpoint, snapshot
from train.config import ModelConfig, TrainConfig
from train.model import Transformer

VOCAB = 32_000  # prepare.py's shared BPE vocabulary for wmt16-en-de
CPU = torch.device("cpu")


def base_state(device: torch.device = CPU) -> dict:
    """What the trainer checkpoints for transformer-base after a step: the model, Adam's two moments, the
    scheduler, the scaler, the configuration, the RNG."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(), VOCAB).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict(),
        "step": 1,
        "best": float("-inf"),
        "config": TrainConfig().to_dict(),
        "rng": {"torch": torch.get_rng_state(), "world_size": 1},
    }


def measure(run_dir: Path, repeats: int = 2, device: torch.device = CPU) -> dict:
    state = base_state(device)
    quiet = lambda line: None  # noqa: E731
    sync = []
    for step in range(1, repeats + 1):
        began = time.perf_counter()
        checkpoint.save(run_dir, step, {**state, "step": step}, keep=2)
        sync.append(time.perf_counter() - began)
    writer = snapshot.StateWriter(device)
    writer.reserve(state)  # as the trainer does after its first step, on the writer thread
    writer.flush()
    stalls, writes = [], []
    for step in range(repeats + 1, 2 * repeats + 1):
        stalls.append(writer.submit({**state, "step": step}, [checkpoint.persist(run_dir, step, 2, False, quiet)]))
        began = time.perf_counter()
        writer.flush()
        writes.append(time.perf_counter() - began)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as memory:
        began = time.perf_counter()
        writer.submit(state, [checkpoint.persist_snapshot(Path(memory), run_dir, 0)])
        writer.flush()
        snapshot_s = time.perf_counter() - began
    writer.close()
    return {
        "mb": snapshot.nbytes(state) / 1e6,
        "sync_s": min(sync),
        "stall_s": min(stalls),
        "ratio": min(stalls) / min(sync),
        "background_write_s": min(writes),
        "snapshot_copy_s": min(stalls),
        "snapshot_write_s": snapshot_s,
        "file_mb": checkpoint.size_mb(checkpoint.list_steps(run_dir)[-1]),
        "device": str(device),
    }


def line(f: dict) -> str:
    return (
        f"transformer-base on {f['device']} ({torch.get_num_threads()} CPU threads): state {f['mb']:.0f} MB "
        f"(file {f['file_mb']:.0f} MB) | sync save {f['sync_s']:.2f} s | async stall {f['stall_s']:.3f} s "
        f"| ratio {f['ratio']:.3f} | background write {f['background_write_s']:.2f} s | snapshot copy "
        f"{f['snapshot_copy_s']:.3f} s, {f['mb']:.0f} MB, written to memory in {f['snapshot_write_s']:.2f} s"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the side-stream copy (to pageable memory)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as run_dir:
        print(line(measure(Path(run_dir), args.repeats, torch.device(args.device))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
