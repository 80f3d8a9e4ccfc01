"""Distributed training with PyTorch DDP: Transformer en-de and ResNet ImageNet recipes.

One process per GPU (per CPU slot locally). The same command works under mpirun, torchrun or alone:

    python -m train.prepare numbers --out /data/datasets/numbers
    python -m train.train --recipe transformer-tiny --data /data/datasets/numbers --run-dir /data/runs/tiny
    torchrun --standalone --nproc-per-node 2 -m train.train --recipe transformer-tiny \
        --data /data/datasets/numbers --run-dir /data/runs/tiny --max-steps 500
    mpirun -H 10.0.0.5:1,10.0.0.6:1 -np 2 -bind-to none -map-by slot \
        -x MASTER_ADDR=10.0.0.5 -x MASTER_PORT=29500 -x NCCL_SOCKET_IFNAME=ens5 -x GLOO_SOCKET_IFNAME=ens5 \
        python -m train.train --recipe transformer-base --data /data/datasets/wmt16-en-de --run-dir /data/runs/base

    python -m train.train --recipe resnet50 --data /data/datasets/imagenet --run-dir /data/runs/r50   # or --synthetic
    python -m train.train --recipe resnet-small --data /data/datasets/fashion-mnist --run-dir /tmp/rs

Run from the directory that holds this package, or with it on PYTHONPATH (the image sets /workspace;
`fab train` builds that mpirun line for you, with -x PYTHONPATH). Re-running the same command resumes from the newest
good checkpoint in --run-dir. `touch RUN_DIR/STOP` (or SIGUSR1) checkpoints and exits cleanly.
"""

import json
import sys
import time
from pathlib import Path
from typing import Sequence

from cluster_node.protocol import phases, rundir
from train import distributed
from train.callbacks import Callback, PhaseMarks, ProgressFile, RankHeartbeat, stacks_on_sigusr2
from train.checkpoint import CheckpointUnreadable
from train.config import (
    ConfigError,
    TrainConfig,
    build_parser,
    config_from_args,
    resolve_precision,
    resume_config,
    settings_line,
)


def effective_config(args):
    """The flags on the recipe for a new run; for a run directory that holds one, its saved
    configuration (a resumed run keeps its settings). Returns (config, changes, resumed): a new run's
    changes are its step counts scaled to its global batch (config.scaled_to_world)."""
    scaled: list[str] = []
    config = config_from_args(args, distributed.detect().world_size, scaled)  # the launcher's, before the rendezvous
    saved = Path(config.run_dir) / rundir.CONFIG
    if not saved.exists():
        return config, scaled, False
    config, changes = resume_config(json.loads(saved.read_text()), args)
    return config, changes, True


def compose(config: TrainConfig, info: distributed.DistInfo, device, callbacks: Sequence[Callback] = ()):
    """The composition root: the recipe's task (model, data, loss, eval), its optimizer and LR schedule,
    handed to the Trainer with the callbacks; then rank 0 records the effective configuration (after the
    trainer resolved `auto` precision and compression) in config.json, which a resume reads."""
    import torch

    from train.recipes import make_task
    from train.trainer import Trainer

    task = make_task(config, info, device)
    optimizer = task.optimizer()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: task.lr_factor(s + 1))
    trainer = Trainer(config, info, device, task, optimizer, scheduler, callbacks)
    if info.is_main:  # with the ranks it trains on: a resume elsewhere keeps its global batch (resume.py)
        saved = {**config.to_dict(), "world_size": info.world_size}
        rundir.write_json(Path(config.run_dir) / rundir.CONFIG, saved, indent=2)
    return trainer


def reporting(config: TrainConfig, info: distributed.DistInfo) -> list[Callback]:
    """For the supervisor's hang watchdog: every rank's heartbeat (and its stacks on SIGUSR2); rank 0's
    progress.json."""
    run_dir = Path(config.run_dir)
    stacks_on_sigusr2(run_dir, info.rank)
    callbacks: list[Callback] = [RankHeartbeat(run_dir, info.rank)]
    if info.is_main:
        callbacks.append(ProgressFile(run_dir, config.max_steps, info.world_size))
        callbacks.append(PhaseMarks(run_dir))
    return callbacks


def _summary_line(summary: dict) -> str:
    shown = ("steps", "avg_step_time_s", "objects_per_s", "eval_loss", "bleu", "top1", "checkpoint_mb")
    values = [(k, summary[k]) for k in shown if summary.get(k) is not None]  # in this order
    return "summary: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values)


def main(argv=None) -> int:
    started = time.time()
    args = build_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    try:
        config, changes, resumed = effective_config(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    info, device = distributed.setup(timeout_s=config.dist_timeout_s)
    run_dir = Path(config.run_dir)
    if info.is_main:  # the start-up's phases; a run directory made here is the trainer's own (no fab)
        run_dir.mkdir(parents=True, exist_ok=True)
        phases.mark(run_dir, "process", started)
        phases.mark(run_dir, "rendezvous")
    precision_why = resolve_precision(config, device) if config.precision == "auto" else ""
    world_batch = config.global_batch(info.world_size)
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
            + "".join(f"; changed {change}" if resumed else f"; {change}" for change in changes),
            flush=True,
        )
    reports = reporting(config, info)
    try:
        trainer = compose(config, info, device, reports)
        if info.is_main:
            phases.mark(run_dir, "ready", step=trainer.step)
        trainer.log(f"{info.world_size} process(es) via {info.launcher} on {device.type}; recipe {config.recipe}")
        trainer.log(_summary_line(trainer.fit()))
    except FileNotFoundError as error:  # no data set on this node
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ConfigError as error:  # a checkpoint this launch cannot resume: the same on every rank, said once
        if info.is_main:
            print(f"error: {error}", file=sys.stderr)
        return 2
    except CheckpointUnreadable as error:  # not a refusal: the supervisor's restart may read it (exit 2 ends the run)
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        for report in reports:  # the newest heartbeat written whatever ends the rank (restart_plan reads it)
            report.close()
        distributed.teardown()
    return 0


if __name__ == "__main__":
    distributed.exit_without_finalizing(main())
