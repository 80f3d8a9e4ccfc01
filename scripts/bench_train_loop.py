#!/usr/bin/env python3
"""The translation input pipeline before and after token batching, then the training loop's
throughput as a ratio to a bare PyTorch loop.

    .venv/bin/python scripts/bench_train_loop.py [--pairs 4500000] [--steps 40] [--rounds 3]
    .venv/bin/python scripts/bench_train_loop.py --task images [--steps 30] [--workers N]

Pipeline (one run, the same model and data, 1 thread): `before` is the old path, reimplemented
here: a torch.randperm over all pairs at every step and rows padded one by one to the longest of 64
random pairs, built synchronously; `after` is the trainer's own (recipes.TranslationTask): token
buckets (sampler.py), the permutation drawn once per epoch, built a step ahead on a thread. Data:
the Ding sentences (`apt-get install trans-de-en`; the numbers data set without it) repeated in
memory to --pairs pairs (4.5M: WMT16 en-de's size). Printed per path: the data wait (the trainer's
step breakdown) as a share of the step, the loader's tokens/s alone against the tokens/s the step
consumes, and the padded share of the batches' tokens.

Ratio: Trainer.train_step against a bare loop on the same model and batches, pre-built as tensors
(no data work), so the ratio is conservative; rounds alternate (this machine is noisy).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from train import prepare
from train.catalog import RECIPES
from train.config import ModelConfig, TrainConfig
from train.data import BOS, EOS, PAD, PairDataset, _pad, global_batch_indices, padded_fraction
from train.distributed import DistInfo
from train.model import Transformer
from train.recipes import TranslationTask, transformer_lr
from train.train import compose
from train.trainer import Trainer


def tiny_config(data: str, run_dir: str, steps: int) -> TrainConfig:
    recipe = dict(RECIPES["transformer-tiny"])
    model = ModelConfig(**recipe.pop("model"))
    return TrainConfig(
        recipe="transformer-tiny",
        model=model,
        **dict(
            recipe,
            data=data,
            run_dir=run_dir,
            max_steps=steps,
            eval_every=10**9,
            checkpoint_every=10**9,
            eval_samples=1,
        ),
    )


def dataset(tmp: str) -> tuple[Path, str]:
    """A prepared data set (Ding when its package is installed, else numbers) and its name."""
    out = Path(tmp) / "data"
    try:
        prepare.main(["ding", "--out", str(out), "--vocab", "2000"])
        return out, "Ding"
    except SystemExit:  # trans-de-en not installed
        prepare.main(["numbers", "--out", str(out), "--train", "5000", "--valid", "50", "--test", "50"])
        return out, "numbers"


def repeated(pairs: PairDataset, size: int) -> PairDataset:
    """`pairs` repeated in memory until it holds `size` pairs (one shard)."""
    copies = -(-size // len(pairs))
    big = PairDataset.__new__(PairDataset)
    big.max_len = pairs.max_len
    stores = []
    for store in (pairs.src, pairs.tgt):
        flat = np.concatenate([f for f, _ in store])
        lengths = np.concatenate([np.diff(o) for _, o in store])
        lengths = np.tile(lengths, copies)[:size]
        offsets = np.zeros(size + 1, dtype=np.int64)
        offsets[1:] = lengths.cumsum()
        stores.append([(np.tile(flat, copies)[: offsets[-1]], offsets)])
    big.src, big.tgt = stores
    big.sizes, big.starts = [size], [0, size]
    return big


def old_batches(pairs: PairDataset, batch: int, seed: int):
    """The path before token batching: randperm over every pair at each step, rows padded one by one."""

    def build(step: int) -> list[tuple[torch.Tensor, ...]]:
        indices = global_batch_indices(step, batch, len(pairs), seed)
        src = [pairs.source(i) for i in indices]
        tgt = [pairs.target(i) for i in indices]
        return [(_pad(src), _pad([[BOS] + t for t in tgt]), _pad([t + [EOS] for t in tgt]))]

    return build


def tokens(batches) -> int:
    return sum(int(b[0].ne(PAD).sum() + b[2].ne(PAD).sum()) for b in batches)


def measure(trainer: Trainer, build, steps: int) -> dict:
    """The loader alone over `steps` steps, then `steps` training steps (after one warm-up)."""
    started, real, pads, total = time.perf_counter(), 0, 0, 0
    for step in range(steps):
        batches = build(step)
        real += tokens(batches)
        for batch in batches:
            pad, count = padded_fraction(batch)
            pads, total = pads + pad, total + count
    loader_s = time.perf_counter() - started
    trainer.train_step()
    trainer.timer.resolve()
    for _ in range(steps):
        trainer.train_step()
    parts = trainer.timer.resolve()
    step_s = sum(p["step_s"] for p in parts) / len(parts)
    data_s = sum(p["data_s"] for p in parts) / len(parts)
    return {
        "step_ms": 1000 * step_s,
        "wait": data_s / step_s,
        "loader": real / loader_s,
        "consumed": real / steps / step_s,
        "padded": pads / total,
    }


def pipeline(args, data: Path, name: str, tmp: str) -> None:
    rows = {}
    for path in ("before", "after"):
        config = tiny_config(str(data), f"{tmp}/{path}", 10**6)
        config.batching = "tokens" if path == "after" else "sentences"
        trainer = compose(config, DistInfo(), torch.device("cpu"))
        task = trainer.task
        task.data.train = repeated(task.data.train, args.pairs)
        if path == "after":
            started = time.perf_counter()
            task.sampler, task.budget, notes = task._sampler()
            print(f"{notes[0]}: epoch 0 drawn and packed in {time.perf_counter() - started:.2f} s")
            build = task._host_batches
        else:
            build = old_batches(task.data.train, config.batch_per_gpu, config.seed)
            task.batches = lambda step, build=build: build(step)  # what TranslationTask.batches did
        rows[path] = measure(trainer, build, args.steps)
    print(
        f"\n{name} sentences repeated to {args.pairs:,} pairs; transformer-tiny, batch 64 (after: as tokens), "
        f"1 thread, {args.steps} steps\n"
    )
    print("| path | ms/step | data wait / step | loader alone, tokens/s | step consumes, tokens/s | padded tokens |")
    print("|---|---|---|---|---|---|")
    for path, r in rows.items():
        print(
            f"| {path} | {r['step_ms']:.0f} | {r['wait']:.1%} | {r['loader']:,.0f} | {r['consumed']:,.0f} "
            f"| {r['padded']:.1%} |"
        )


def time_trainer(config: TrainConfig) -> float:
    trainer = compose(config, DistInfo(), torch.device("cpu"))
    trainer.train_step()  # warm-up, as for the bare loop
    config.max_steps += 1
    started = time.perf_counter()
    while trainer.step < config.max_steps:
        trainer.train_step()
        if trainer.writer:
            trainer.writer.add_scalar("train/loss", 0.0, trainer.step)
    return (time.perf_counter() - started) / (config.max_steps - 1)


def time_bare(config: TrainConfig) -> float:
    task = TranslationTask(config, DistInfo(), torch.device("cpu"))  # for its batches only
    torch.manual_seed(config.seed)
    model = Transformer(config.model, task.data.tokenizer.vocab_size)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=config.adam_betas, eps=config.adam_eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: transformer_lr(s + 1, config.model.d_model, config.warmup_steps, config.lr_scale)
    )
    batches = [task._host_batches(s)[0] for s in range(config.max_steps)]

    def step(src, tgt_in, tgt_out):
        loss = F.cross_entropy(
            model(src, tgt_in).flatten(0, 1),
            tgt_out.flatten(),
            ignore_index=PAD,
            label_smoothing=config.label_smoothing,
            reduction="sum",
        )
        (loss / tgt_out.ne(PAD).sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()

    model.train()
    step(*batches[0])
    started = time.perf_counter()
    for batch in batches[1:]:
        step(*batch)
    return (time.perf_counter() - started) / (len(batches) - 1)


def ratio(args, data: Path, tmp: str) -> None:
    ratios = []
    for round_ in range(args.rounds):
        config = tiny_config(str(data), f"{tmp}/run{round_}", args.steps)
        trainer_s = time_trainer(config)
        bare_s = time_bare(tiny_config(str(data), f"{tmp}/bare{round_}", args.steps))
        ratios.append(bare_s / trainer_s)
        print(
            f"round {round_ + 1}: trainer {trainer_s * 1000:.1f} ms/step, bare {bare_s * 1000:.1f} ms/step, "
            f"throughput ratio {ratios[-1]:.3f}"
        )
    print(
        f"training-loop throughput / bare PyTorch loop: median {statistics.median(ratios):.3f} "
        f"(target >= 0.95) over {args.rounds} rounds of {args.steps} steps, batch 64 "
        "(the recipe's sentence batches), 1 thread"
    )


# --- images (issue 21 §3): the synchronous float32 host pipeline against imagepipe.py, in Trainer.fit's
# own train_step, on Fashion-MNIST (28 px JPEGs) and on generated ImageNet-sized JPEGs. ---------------


def image_folders(tmp: Path) -> dict[str, tuple[Path, int]]:
    """Data set name -> (folder, image size): Fashion-MNIST (if its package is installed) at 32 px,
    and 400x300 generated JPEGs (ImageNet's typical size, photo-like gradients) cropped to 64 px."""
    from PIL import Image

    folders = {}
    try:
        prepare.main(
            ["fashion-mnist", "--out", str(tmp / "fashion"), "--train-per-class", "200", "--val-per-class", "1"]
        )
        folders["fashion-mnist 28px -> 32"] = (tmp / "fashion", 32)
    except SystemExit as error:
        print(f"fashion-mnist skipped: {error}")
    generated = tmp / "generated"
    for split, count in (("train", 160), ("val", 2)):
        for label in range(4):
            (generated / split / f"c{label}").mkdir(parents=True)
            for i in range(count):
                gradient = Image.linear_gradient("L").resize((400, 300)).rotate(i * 7 + label * 90)
                image = Image.merge("RGB", (gradient, gradient.transpose(Image.Transpose.FLIP_LEFT_RIGHT), gradient))
                image.save(generated / split / f"c{label}" / f"{i}.jpg", quality=90)
    folders["generated 400x300 -> 64"] = (generated, 64)
    return folders


def image_config(data: Path, run_dir: str, size: int, workers: int, batch: int):
    from train.config import build_parser, config_from_args

    argv = ["--recipe", "resnet-small", "--data", str(data), "--run-dir", run_dir, "--image-size", str(size)]
    argv += ["--batch-per-gpu", str(batch), "--workers", str(workers), "--eval-every", "1000000"]
    return config_from_args(build_parser("").parse_args(argv + ["--checkpoint-every", "1000000"]))


def synchronous_batches(task):
    """The pipeline before issue 21 §3: decode and normalise as float32 in the training process
    (2 threads, the recipe's old setting), a blocking copy, no prefetch."""
    from concurrent.futures import ThreadPoolExecutor

    from train.vision import load_batch

    c, pool = task.config, ThreadPoolExecutor(max_workers=2)

    def batches(step):
        out = []
        for micro in range(c.grad_accum):
            position = step * c.grad_accum + micro
            indices = global_batch_indices(position, c.batch_per_gpu, len(task.train), c.seed)
            images, labels = load_batch(task.train, indices, c.vision.image_size, True, c.seed * 7919 + position, pool)
            out.append((images.to(task.device), labels.to(task.device)))
        return out

    return batches


def time_image_steps(config, synchronous: bool, steps: int) -> dict:
    """Data wait and step time (the trainer's own breakdown), and the loader alone in images/s."""
    trainer = compose(config, DistInfo(), torch.device("cpu"))
    task = trainer.task
    batches = synchronous_batches(task) if synchronous else task.batches
    task.batches = batches
    for _ in range(3):  # warm-up: workers started, first batches decoded
        trainer.train_step()
    trainer.timer.resolve()
    for _ in range(steps):
        trainer.train_step()
    parts = trainer.timer.resolve()
    wait = statistics.mean(p["data_s"] for p in parts)
    step = statistics.mean(p["step_s"] for p in parts)
    batches(10_000)  # the loader alone: restart at a far position, time batches with no compute
    started = time.perf_counter()
    for position in range(10_001, 10_001 + steps):
        batches(position)
    alone = steps * config.batch_per_gpu / (time.perf_counter() - started)
    return {"wait": wait, "step": step, "alone": alone, "consumes": config.batch_per_gpu / (step - wait)}


def bench_images(args: argparse.Namespace) -> None:
    from train.imagepipe import workers_for

    torch.set_num_threads(1)
    workers = workers_for(args.workers)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (folder, size) in image_folders(Path(tmp)).items():
            for label, synchronous in (("before: sync float32", True), (f"after: {workers} worker(s), uint8", False)):
                config = image_config(folder, f"{tmp}/run-{len(rows)}", size, 0 if synchronous else args.workers, 32)
                rows.append((name, label, time_image_steps(config, synchronous, args.steps)))
    print(f"\nresnet-small (ResNet-18 width 16), batch 32, 1 compute thread, {args.steps} steps, CPU")
    print("| data set | pipeline | data wait / step | step | loader alone | step consumes |")
    print("|---|---|---|---|---|---|")
    for name, label, r in rows:
        print(
            f"| {name} | {label} | {100 * r['wait'] / r['step']:.1f}% ({1000 * r['wait']:.1f} ms) | "
            f"{1000 * r['step']:.0f} ms | {r['alone']:.0f} img/s | {r['consumes']:.0f} img/s |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=4_500_000, help="pairs in memory (WMT16 en-de: ~4.5M)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3, help="trainer / bare loop rounds (0: none)")
    parser.add_argument("--task", choices=["text", "images"], default="text")
    parser.add_argument("--workers", type=int, default=-1, help="images: decode processes (-1: from the CPUs)")
    args = parser.parse_args()
    if args.task == "images":
        return bench_images(args)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        data, name = dataset(tmp)
        pipeline(args, data, name, tmp)
        if args.rounds:
            print()
            ratio(args, data, tmp)


if __name__ == "__main__":
    main()
