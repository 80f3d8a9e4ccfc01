"""The validated training configuration: a named recipe (catalog.py) and every field overridable from the
command line."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from train.catalog import ATTENTION, COMPRESSIONS, PRECISIONS, RECIPES, dataset_dir, either


class ConfigError(ValueError):
    pass


def _check(condition: bool, name: str, value, accepted: str) -> None:
    if not condition:
        raise ConfigError(f"invalid --{name.replace('_', '-')} {value!r}: {accepted}")


@dataclass
class ModelConfig:
    d_model: int = 512
    layers: int = 6
    heads: int = 8
    ffn: int = 2048
    dropout: float = 0.1
    max_len: int = 256
    pre_norm: bool = False

    def validate(self) -> None:
        _check(
            self.d_model > 0 and self.d_model % max(self.heads, 1) == 0,
            "d_model",
            self.d_model,
            "a positive multiple of --heads",
        )
        _check(self.heads > 0, "heads", self.heads, "a positive whole number")
        _check(self.layers > 0, "layers", self.layers, "a positive whole number")
        _check(self.ffn > 0, "ffn", self.ffn, "a positive whole number")
        _check(0.0 <= self.dropout < 1.0, "dropout", self.dropout, "a number in [0, 1)")
        _check(self.max_len >= 8, "max_len", self.max_len, "at least 8 tokens")


@dataclass
class VisionConfig:
    arch: str = "resnet50"
    width: int = 64
    image_size: int = 224
    num_classes: int = 1000
    synthetic: bool = False
    base_lr: float = 0.256
    momentum: float = 0.875
    weight_decay: float = 3.0517578125e-05
    # Decoding processes per rank: -1 derives them from the node's CPUs and ranks (imagepipe.workers_for),
    # 0 decodes in the training process.
    workers: int = -1

    def validate(self) -> None:
        from train.vision import ARCHS

        _check(self.arch in ARCHS, "arch", self.arch, f"one of {', '.join(ARCHS)}")
        _check(self.width >= 8, "width", self.width, "at least 8")
        _check(self.image_size >= 16, "image_size", self.image_size, "at least 16 pixels")
        _check(self.num_classes >= 2, "num_classes", self.num_classes, "at least 2")
        _check(self.base_lr > 0, "base_lr", self.base_lr, "a positive number (per 256 images)")
        _check(0 <= self.momentum < 1, "momentum", self.momentum, "in [0, 1)")
        _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "0 or a positive number")
        _check(
            self.workers >= -1,
            "workers",
            self.workers,
            "-1 (from the node's CPUs), 0 (in the training process) or more",
        )


@dataclass
class TrainConfig:
    recipe: str = "transformer-base"
    data: str = dataset_dir("wmt16-en-de")
    run_dir: str = "/data/runs/default"
    max_steps: int = 50_000
    # The global batch the step counts (max_steps, warmup_steps, eval_every) are for, 0: steps whatever the
    # global batch. A recipe that has one trains its samples on any number of ranks (scaled_to_world).
    reference_batch: int = 0
    batch_per_gpu: int = 128
    grad_accum: int = 1
    batching: str = "tokens"  # translation: token-budget buckets (sampler.py), or "sentences"
    max_tokens: int = 0  # tokens per micro-batch; 0: --batch-per-gpu x the mean pair length
    pad_multiple: int = 8  # token batches' lengths rounded up to this (sampler.ShapeBuckets); 1: to the longest
    attention: str = "auto"  # SDPA backends on CUDA (perf.ATTENTION): auto leaves cuDNN's per-shape graphs out
    compile: bool = False  # torch.compile the model for training steps
    warm_shapes: int = -1  # the commonest batch shapes run once before step 1 (perf.warm_shapes); -1: 64 on a GPU
    precision: str = "auto"  # choose_precision
    grad_compression: str = "none"
    powersgd_rank: int = 4
    lr_scale: float = 2.0
    warmup_steps: int = 8000
    adam_betas: tuple = (0.9, 0.98)
    adam_eps: float = 1e-9
    label_smoothing: float = 0.1
    clip_grad: float = 0.0
    seed: int = 1234
    log_every: int = 100
    eval_every: int = 2000
    eval_samples: int = 1000
    eval_batch: int = 64
    beam: int = 1
    checkpoint_every: int = 2000
    checkpoint_minutes: float = 30.0  # and at least this often (0: off); docs/operations.md, When nodes fail
    keep_checkpoints: int = 3
    # Each node's in-memory snapshot (train.snapshot), 0: off. Its copy stalls the loop ~0.1 s on CPU for
    # transformer-base (scripts/bench_checkpoint.py): every 60 s is under 0.3%, and a lost node loses <= 60 s.
    snapshot_seconds: float = 60.0
    bucket_cap_mb: float = 25.0
    dist_timeout_s: float = 300.0
    target_metric: Optional[float] = None  # end early once eval BLEU (or top1) reaches it
    model: ModelConfig = field(default_factory=ModelConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)

    @property
    def task(self) -> str:
        return "image" if self.recipe.startswith("resnet") else "translation"

    def validate(self) -> None:
        _check(self.recipe in RECIPES, "recipe", self.recipe, f"one of {', '.join(RECIPES)}")
        _check(self.max_steps > 0, "max_steps", self.max_steps, "a positive whole number")
        _check(self.reference_batch >= 0, "reference_batch", self.reference_batch, "0 (off) or a global batch")
        _check(self.batch_per_gpu > 0, "batch_per_gpu", self.batch_per_gpu, "a positive whole number")
        _check(self.grad_accum > 0, "grad_accum", self.grad_accum, "a positive whole number")
        precisions = ("auto", *PRECISIONS)
        _check(self.precision in precisions, "precision", self.precision, either(precisions))
        _check(self.batching in ("tokens", "sentences"), "batching", self.batching, "tokens or sentences")
        _check(self.max_tokens >= 0, "max_tokens", self.max_tokens, "0 (from --batch-per-gpu) or a positive number")
        _check(self.pad_multiple > 0, "pad_multiple", self.pad_multiple, "1 (pad to the longest) or more")
        _check(self.warm_shapes >= -1, "warm_shapes", self.warm_shapes, "-1 (64 on a GPU, none on a CPU) or a count")
        _check(self.attention in ATTENTION, "attention", self.attention, either(ATTENTION))
        _check(self.grad_compression in COMPRESSIONS, "grad_compression", self.grad_compression, either(COMPRESSIONS))
        _check(self.powersgd_rank > 0, "powersgd_rank", self.powersgd_rank, "a positive whole number")
        _check(self.lr_scale > 0, "lr_scale", self.lr_scale, "a positive number")
        _check(0 < self.adam_eps < 1, "adam_eps", self.adam_eps, "a small positive number")
        _check(self.warmup_steps > 0, "warmup_steps", self.warmup_steps, "a positive whole number")
        _check(0.0 <= self.label_smoothing < 1.0, "label_smoothing", self.label_smoothing, "in [0, 1)")
        _check(self.clip_grad >= 0, "clip_grad", self.clip_grad, "0 (off) or a positive number")
        minutes = self.checkpoint_minutes
        _check(minutes >= 0, "checkpoint_minutes", minutes, "0 (steps only) or a positive number of minutes")
        seconds = self.snapshot_seconds
        _check(seconds >= 0, "snapshot_seconds", seconds, "0 (off) or a positive number of seconds")
        for name in (
            "log_every",
            "eval_every",
            "checkpoint_every",
            "keep_checkpoints",
            "eval_samples",
            "eval_batch",
            "beam",
        ):
            _check(getattr(self, name) > 0, name, getattr(self, name), "a positive whole number")
        _check(self.dist_timeout_s >= 10, "dist_timeout_s", self.dist_timeout_s, "at least 10 seconds")
        _check(self.bucket_cap_mb > 0, "bucket_cap_mb", self.bucket_cap_mb, "a positive number")
        if self.task == "image":
            self.vision.validate()
        else:
            self.model.validate()

    def global_batch(self, world_size: int) -> int:
        """Objects (sentences or images) an optimizer step takes over `world_size` ranks."""
        return self.batch_per_gpu * world_size * self.grad_accum

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        values = dict(values)
        values.pop("world_size", None)  # the ranks it was trained on (train.compose), not a setting
        model = ModelConfig(**values.pop("model"))
        vision = VisionConfig(**values.pop("vision", {}))
        values["adam_betas"] = tuple(values["adam_betas"])
        values.setdefault("batching", "sentences")  # runs saved before token batching keep their samples
        values.setdefault("pad_multiple", 1)  # and those saved before shape buckets keep theirs
        return cls(model=model, vision=vision, **values)


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _add_fields(parser: argparse.ArgumentParser, cls, prefix: str = "") -> None:
    for f in dataclasses.fields(cls):
        if f.name in ("model", "vision", "recipe"):
            continue
        flag = "--" + (prefix + f.name).replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.type in ("bool",):
            parser.add_argument(
                flag, type=_parse_bool, nargs="?", const=True, default=None, help=f"(default {default})"
            )
        elif f.type == "tuple":
            parser.add_argument(flag, type=float, nargs=2, default=None, help=f"(default {default})")
        else:
            kind = {"int": int, "float": float, "str": str, "Optional[float]": float}[str(f.type)]
            parser.add_argument(flag, type=kind, default=None, dest=prefix + f.name, help=f"(default {default})")


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="transformer-base", choices=sorted(RECIPES))
    _add_fields(parser, TrainConfig)
    _add_fields(parser, ModelConfig)
    parser.add_argument(
        "--keep-global-batch",
        type=int,
        default=None,
        help="resuming on another number of ranks (fab train --max-restarts): allow new --batch-per-gpu and "
        "--grad-accum whose product with the world size is this global batch",
    )
    _add_fields(parser, VisionConfig)
    return parser


# --synthetic measures throughput, it learns nothing: 500 steps are past the start-up and cuDNN's
# autotuning (minutes, not the hours of resnet50's 90-epoch schedule on GPUs that bill by the hour).
SYNTHETIC_STEPS = 500


def config_from_args(args: argparse.Namespace, world_size: int = 1, scaled: Optional[list[str]] = None) -> TrainConfig:
    """Recipe defaults, then every flag the user gave, the step counts scaled to `world_size` ranks'
    global batch (scaled_to_world: its lines appended to `scaled`); validated. A synthetic run without
    --max-steps is a SYNTHETIC_STEPS benchmark (or the recipe's own length if that is shorter)."""
    recipe: dict[str, Any] = dict(RECIPES[args.recipe])
    model = ModelConfig(**recipe.pop("model", {}))
    vision = VisionConfig(**recipe.pop("vision", {}))
    config = TrainConfig(recipe=args.recipe, model=model, vision=vision, **recipe)
    given = {k: v for k, v in vars(args).items() if v is not None and k not in ("recipe", "keep_global_batch")}
    for key, value in given.items():
        target = next(part for part in (config.model, config.vision, config) if hasattr(part, key))
        setattr(target, key, tuple(value) if isinstance(value, list) else value)
    counted = set(given)
    if config.vision.synthetic and "max_steps" not in given:  # a benchmark's length, in steps: not scaled
        config.max_steps = min(config.max_steps, SYNTHETIC_STEPS)
        counted.add("max_steps")
    lines = scaled_to_world(config, world_size, counted)
    if scaled is not None:
        scaled += lines
    config.validate()
    return config


# A recipe's step counts, as many samples (and the same evaluations) at any global batch.
SCALED_STEPS = ("max_steps", "warmup_steps", "eval_every")


def scaled_to_world(config: TrainConfig, world_size: int, given: set[str]) -> list[str]:
    """With a reference_batch (the resnet50 recipe's 2,048: 8 ranks x 256), each step count not given as a
    flag is scaled to this run's global batch: 16 ranks train the recipe's 90 epochs in half the steps, as
    its LR, scaled with the global batch (Goyal et al.), assumes; a fixed step count would train 180 epochs
    and bill twice. A run given --max-steps has chosen its length in steps: nothing is scaled (its warm-up
    scaled to one GPU could outlast it). A new run's config.json keeps the counts: a resume keeps them.
    Returns a line saying what was scaled, or what was kept at another global batch; none for neither."""
    global_batch = config.global_batch(world_size)
    if not config.reference_batch or global_batch == config.reference_batch:
        return []
    why = f"the recipe's for a global batch of {config.reference_batch}, this run's is {global_batch}"
    if "max_steps" in given:
        kept = [f"{name} {getattr(config, name)}" for name in SCALED_STEPS if name not in given]
        return [f"step counts kept: {', '.join(kept)}, {why} (its length given in steps)"] if kept else []
    lines = []
    for name in SCALED_STEPS:
        if name not in given:
            before = getattr(config, name)
            setattr(config, name, max(1, math.ceil(before * config.reference_batch / global_batch)))
            lines.append(f"{name} {before} -> {getattr(config, name)}")
    return [f"step counts scaled: {', '.join(lines)} ({why})"] if lines else []


# What a resumed run may change: how long it runs and how it reports, never what it trains.
RESUMABLE_CHANGES = {
    "max_steps",
    "log_every",
    "eval_every",
    "eval_samples",
    "eval_batch",
    "checkpoint_every",
    "checkpoint_minutes",
    "keep_checkpoints",
    "snapshot_seconds",
    "dist_timeout_s",
    "target_metric",
    "beam",
    "attention",  # which kernels compute the step, not what it computes
    "compile",
    "warm_shapes",  # what runs before step 1, nothing kept
    "workers",  # how images are decoded, not which: the batches are the same (test_imagepipe.py)
}


def _field_value(config: TrainConfig, key: str):
    part = next(p for p in (config.model, config.vision, config) if hasattr(p, key))
    return getattr(part, key)


def resume_config(saved: dict, args: argparse.Namespace) -> tuple[TrainConfig, list[str]]:
    """A resumed run's configuration: the one saved in its run directory. A flag given now that
    differs is refused in one line, unless it only changes the length or the reporting of the run
    (RESUMABLE_CHANGES). Returns the configuration and a line per change applied."""
    config = TrainConfig.from_dict(saved)
    if args.recipe != config.recipe:
        raise ConfigError(
            f"--recipe {args.recipe} differs from the run's {config.recipe}: a resumed run keeps "
            "its settings; start a new --run to change them"
        )
    changes = []
    rebalance = {"batch_per_gpu", "grad_accum"} if getattr(args, "keep_global_batch", None) else set()
    for key, value in vars(args).items():
        if value is None or key in ("recipe", "keep_global_batch"):
            continue
        value = tuple(value) if isinstance(value, list) else value
        current = _field_value(config, key)
        if value == current:
            continue
        flag = "--" + key.replace("_", "-")
        if key not in RESUMABLE_CHANGES | rebalance:
            raise ConfigError(
                f"{flag} {value!r} differs from the run's {current!r}: a resumed run keeps its "
                "settings; start a new --run to change them"
            )
        part = next(p for p in (config.model, config.vision, config) if hasattr(p, key))
        setattr(part, key, value)
        changes.append(f"{flag} {current!r} -> {value!r}")
    config.validate()
    return config, changes


def choose_precision(
    requested: str,
    device_type: str,
    capability: Optional[tuple[int, int]],
    bf16_supported: bool,
    convolutional: bool = False,
) -> tuple[str, str]:
    """(precision, why). `auto` is mixed precision where tensor cores are: bf16 from compute capability
    8.0 (Ampere: bf16 tensor cores; below it is_bf16_supported() can mean emulation), fp16 with a
    GradScaler on 7.x (V100, T4), fp32 on CPUs and older GPUs. A convolutional network takes fp16 with
    the GradScaler on every tensor-core GPU: cuDNN's fp16 convolutions and batch norms in channels-last
    are faster than its bf16 ones (the ResNet-50 recipe on one H100: 55 ms a step in fp16, 66 in bf16,
    where a plain bf16 loop took 64). An explicit choice wins."""
    if requested != "auto":
        return requested, "as requested"
    if device_type != "cuda" or capability is None:
        return "fp32", "auto: no CUDA device"
    cc = f"compute capability {capability[0]}.{capability[1]}"
    if capability >= (7, 0) and convolutional:
        return "fp16", f"auto: {cc}, a convolutional network: faster in fp16 than bf16; loss scaling on"
    if capability >= (8, 0) and bf16_supported:
        return "bf16", f"auto: {cc} has bf16 tensor cores"
    if capability >= (7, 0):
        return "fp16", f"auto: {cc} has fp16 tensor cores, no bf16 ones; loss scaling on"
    return "fp32", f"auto: {cc} has no tensor cores"


def resolve_precision(config: TrainConfig, device) -> str:
    """Sets config.precision for this device (see choose_precision); returns why."""
    import torch

    cuda = device.type == "cuda"
    capability = torch.cuda.get_device_capability(device) if cuda else None
    bf16 = cuda and torch.cuda.is_bf16_supported()
    convolutional = config.task == "image"
    config.precision, why = choose_precision(config.precision, device.type, capability, bf16, convolutional)
    return why


def settings_line(config: TrainConfig, precision_why: str = "") -> str:
    """The effective settings, in one line (printed at start; kept in config.json and the summary)."""
    steps = f"{config.max_steps} steps"
    if config.vision.synthetic and config.max_steps == SYNTHETIC_STEPS:
        steps += " (synthetic data: a benchmark's default length; fab train --steps N for more)"
    batch = f"batch {config.batch_per_gpu}/GPU"
    if config.task == "translation" and config.batching == "tokens":
        batch += f" as {config.max_tokens} tokens" if config.max_tokens else " as tokens (x mean pair length)"
    why = f" ({precision_why})" if precision_why else ""
    return (
        f"settings: recipe {config.recipe}, {steps}, {batch} x "
        f"accumulation {config.grad_accum}, precision {config.precision}{why}, gradient compression "
        f"{config.grad_compression}, lr scale {config.lr_scale}, warm-up {config.warmup_steps}, seed {config.seed}"
    )
