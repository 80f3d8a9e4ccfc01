"""Distributed training with PyTorch DDP: Transformer en-de and ResNet ImageNet recipes.

One process per GPU (per CPU slot locally). The same command works under mpirun, torchrun or alone:

    python -m train.prepare numbers --out /data/datasets/numbers
    python -m train.train --recipe transformer-tiny --data /data/datasets/numbers --run-dir /data/runs/tiny
    torchrun --standalone --nproc-per-node 2 -m train.train --recipe transformer-tiny \
        --data /data/datasets/numbers --run-dir /data/runs/tiny --max-steps 500
    mpirun -H 10.0.0.5:1,10.0.0.6:1 -np 2 -bind-to none -map-by slot \
        -x MASTER_ADDR=10.0.0.5 -x MASTER_PORT=29500 -x NCCL_SOCKET_IFNAME=ens5 \
        python -m train.train --recipe transformer-base --data /data/datasets/wmt16-en-de --run-dir /data/runs/base

    python -m train.train --recipe resnet50 --data /data/imagenet --run-dir /data/runs/r50   # or --synthetic
    python -m train.train --recipe resnet-small --data /data/datasets/fashion-mnist --run-dir /tmp/rs

(`fab train` builds that mpirun line for you.) Re-running the same command resumes from the newest
good checkpoint in --run-dir. `touch RUN_DIR/STOP` (or SIGUSR1) checkpoints and exits cleanly.
"""

import sys
from pathlib import Path

from train import distributed
from train.config import (
    ConfigError,
    build_parser,
    config_from_args,
    resolve_precision,
    resume_config,
    settings_line,
)


def effective_config(args):
    """The flags on the recipe for a new run; for a run directory that holds one, its saved
    configuration (a resumed run keeps its settings). Returns (config, changes, resumed)."""
    config = config_from_args(args)
    saved = Path(config.run_dir) / "config.json"
    if not saved.exists():
        return config, [], False
    import json

    config, changes = resume_config(json.loads(saved.read_text()), args)
    return config, changes, True


def watchable(trainer, run_dir: Path, rank: int) -> None:
    """For the launcher's hang watchdog: RUN_DIR/ranks/rankN holds this rank's last finished step
    and pid; SIGUSR2 appends this rank's Python stacks to RUN_DIR/stacks/rankN.txt."""
    import faulthandler
    import os
    import signal
    import socket

    for sub in ("ranks", "stacks"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    faulthandler.register(signal.SIGUSR2, file=open(run_dir / "stacks" / f"rank{rank}.txt", "a"), all_threads=True)
    beat, step = run_dir / "ranks" / f"rank{rank}", trainer.train_step
    origin = f"{os.getpid()} {socket.gethostname()}"

    def train_step():
        out = step()
        beat.write_text(f"{trainer.step} {origin}\n")
        return out

    trainer.train_step = train_step


def main(argv=None) -> int:
    args = build_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    try:
        config, changes, resumed = effective_config(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    info, device = distributed.setup(timeout_s=config.dist_timeout_s)
    precision_why = resolve_precision(config, device) if config.precision == "auto" else ""
    world_batch = config.batch_per_gpu * config.grad_accum * info.world_size
    if args.keep_global_batch and world_batch != args.keep_global_batch:
        print(
            f"error: --keep-global-batch {args.keep_global_batch} but the global batch is {world_batch}",
            file=sys.stderr,
        )
        return 2
    if info.is_main:
        print(
            ("resuming with the run's saved " if resumed else "")
            + settings_line(config, precision_why)
            + "".join(f"; changed {change}" for change in changes),
            flush=True,
        )
    try:
        from train.trainer import Trainer

        trainer = Trainer(config, info, device)
        watchable(trainer, Path(config.run_dir), info.rank)
        trainer.log(f"{info.world_size} process(es) via {info.launcher} on {device.type}; recipe {config.recipe}")
        summary = trainer.fit()
        trainer.log(
            "summary: "
            + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in summary.items()
                if k in ("steps", "avg_step_time_s", "objects_per_s", "eval_loss", "bleu", "top1", "checkpoint_mb")
                and v is not None
            )
        )
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        distributed.teardown()
    return 0


if __name__ == "__main__":
    distributed.exit_without_finalizing(main())
