"""All-reduce bandwidth between the ranks (fab check): prints algorithm and bus bandwidth; first, the matrix
product peak every rank's device reaches (the slowest rank's), beside the datasheet figure MFU is taken of."""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from train import distributed, perf


def peak_line(info, device) -> None:
    """`matmul peak: 712.3 TFLOP/s bfloat16, the slowest of 8 rank(s) (NVIDIA H100 80GB HBM3; datasheet 989.4)`."""
    dtype, tflops = perf.measured_peak(device)
    slowest = torch.tensor([tflops], dtype=torch.float64, device=device)
    if info.world_size > 1:
        dist.all_reduce(slowest, op=dist.ReduceOp.MIN)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    datasheet = perf.peak_tflops(name)
    if info.is_main:
        sheet = f"datasheet {datasheet:g}" if datasheet else "no datasheet peak known"
        ranks = f"the slowest of {info.world_size} rank(s)"
        print(f"matmul peak: {slowest.item():.3g} TFLOP/s {dtype}, {ranks} ({name}; {sheet})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=float, default=64.0)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    info, device = distributed.setup(timeout_s=60)
    peak_line(info, device)
    tensor = torch.ones(int(args.mb * 2**20 / 4), device=device)
    times = []
    for i in range(args.warmup + args.iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if info.world_size > 1:
            dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    # The median iteration: on shared CPUs one descheduled iteration would otherwise drag the mean
    # (measured on 2 emulated nodes at 1 Gbit: mean of 5 after 1 warm-up 0.89-0.96 of the cap).
    seconds = statistics.median(times)
    if info.is_main:
        algbw = args.mb * 2**20 * 8 / seconds / 1e9 if seconds else 0.0
        busbw = algbw * 2 * (info.world_size - 1) / info.world_size
        print(
            f"all_reduce {args.mb:.0f} MB over {info.world_size} ranks: {seconds * 1000:.0f} ms, "
            f"algbw {algbw:.2f} Gbit/s, busbw {busbw:.2f} Gbit/s (median of {args.iters})",
            flush=True,
        )
    distributed.teardown()


if __name__ == "__main__":
    main()
    distributed.exit_without_finalizing(0)
