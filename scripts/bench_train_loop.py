#!/usr/bin/env python3
"""Throughput of the training loop (Trainer.fit: data, AMP/scaler, LR schedule, clipping, TensorBoard,
progress file) as a ratio to a bare PyTorch loop on the same model and the same batches.

    .venv/bin/python scripts/bench_train_loop.py [--steps 60] [--rounds 3]

The bare loop gets its batches pre-built as tensors (no data work), so the ratio is conservative.
Rounds alternate trainer/bare in one process (this machine is noisy); the median ratio is printed.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "assets" / "train"))

import prepare  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from config import RECIPES, ModelConfig, TrainConfig  # noqa: E402
from data import PAD, DataSet, global_batch_indices  # noqa: E402
from distributed import DistInfo  # noqa: E402
from model import Transformer  # noqa: E402
from tasks import transformer_lr  # noqa: E402
from trainer import Trainer  # noqa: E402


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


def time_trainer(config: TrainConfig) -> float:
    trainer = Trainer(config, DistInfo(), torch.device("cpu"))
    trainer.train_step()  # warm-up, as for the bare loop
    config.max_steps += 1
    started = time.perf_counter()
    while trainer.step < config.max_steps:
        trainer.train_step()
        if trainer.writer:
            trainer.writer.add_scalar("train/loss", 0.0, trainer.step)
    return (time.perf_counter() - started) / (config.max_steps - 1)


def time_bare(config: TrainConfig, trainer_data: DataSet) -> float:
    torch.manual_seed(config.seed)
    model = Transformer(config.model, trainer_data.tokenizer.vocab_size)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=config.adam_betas, eps=config.adam_eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: transformer_lr(s + 1, config.model.d_model, config.warmup_steps, config.lr_scale)
    )
    batches = [
        trainer_data.train.batch(global_batch_indices(s, config.batch_per_gpu, len(trainer_data.train), config.seed))
        for s in range(config.max_steps)
    ]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "numbers"
        prepare.main(["numbers", "--out", str(data), "--train", "5000", "--valid", "50", "--test", "50"])
        ratios = []
        for round_ in range(args.rounds):
            config = tiny_config(str(data), f"{tmp}/run{round_}", args.steps)
            trainer_s = time_trainer(config)
            bare_config = tiny_config(str(data), f"{tmp}/bare{round_}", args.steps)
            bare_s = time_bare(bare_config, DataSet(data, bare_config.model.max_len))
            ratios.append(bare_s / trainer_s)
            print(
                f"round {round_ + 1}: trainer {trainer_s * 1000:.1f} ms/step, bare {bare_s * 1000:.1f} ms/step, "
                f"throughput ratio {ratios[-1]:.3f}"
            )
    print(
        f"training-loop throughput / bare PyTorch loop: median {statistics.median(ratios):.3f} "
        f"(target >= 0.95) over {args.rounds} rounds of {args.steps} steps, batch 64, 1 thread"
    )


if __name__ == "__main__":
    main()
