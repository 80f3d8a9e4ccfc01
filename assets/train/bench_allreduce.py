"""All-reduce bandwidth between the ranks (fab check): prints algorithm and bus bandwidth."""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import distributed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=64.0)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    info, device = distributed.setup(timeout_s=60)
    tensor = torch.ones(int(args.mb * 2**20 / 4), device=device)
    if info.world_size > 1:
        dist.all_reduce(tensor)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        if info.world_size > 1:
            dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.iters
    if info.is_main:
        algbw = args.mb * 2**20 * 8 / seconds / 1e9 if seconds else 0.0
        busbw = algbw * 2 * (info.world_size - 1) / info.world_size
        print(
            f"all_reduce {args.mb:.0f} MB over {info.world_size} ranks: {seconds * 1000:.0f} ms, "
            f"algbw {algbw:.2f} Gbit/s, busbw {busbw:.2f} Gbit/s",
            flush=True,
        )
    distributed.teardown()


if __name__ == "__main__":
    main()
