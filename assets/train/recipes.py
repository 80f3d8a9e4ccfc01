"""What differs between recipes, behind one small interface the trainer drives:
model, this rank's micro-batches for a step (a fixed function of seed and step), summed loss and the
units it is normalised by, optimizer, LR schedule, evaluation."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from train import checkpoint, distributed
from train.config import TrainConfig
from train.data import PAD, DataSet, rank_slice
from train.perf import ShapeStats, resnet_forward_flops, transformer_flops
from train.sampler import (
    Prefetcher,
    SentenceBatches,
    ShapeBuckets,
    TokenBuckets,
    pair_costs,
    round_up,
    side_costs,
    token_budget,
)


def transformer_lr(step: int, d_model: int, warmup: int, scale: float) -> float:
    """scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step counted from 1."""
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def warmup_cosine_lr(step: int, warmup: int, total: int, peak: float) -> float:
    """Linear warm-up to `peak`, then cosine decay to 0 at `total`; step counted from 1."""
    if step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


class TranslationTask:
    objects = "sentence pairs"
    metric = "bleu"
    varied_shapes = True  # token batches: a shape class a step (trainer.py compiles with symbolic shapes)

    def __init__(self, config: TrainConfig, info: distributed.DistInfo, device: torch.device):
        from train.model import Transformer

        self.config, self.info, self.device = config, info, device
        self.data = DataSet(config.data, config.model.max_len)
        torch.manual_seed(config.seed)  # the same initial weights for any world size
        self.vocab = self.data.tokenizer.vocab_size
        self.model = Transformer(config.model, self.vocab).to(device)
        self.sampler, self.budget, self.notes = self._sampler()
        self.loader = Prefetcher(self._prepared)
        self.shapes = ShapeStats()

    def _sampler(self) -> tuple[TokenBuckets | ShapeBuckets | SentenceBatches, int, list[str]]:
        """The sampler, the token budget per micro-batch (0 for sentences) and what to log about it."""
        c, world = self.config, self.info.world_size
        if c.batching == "sentences":
            return SentenceBatches(len(self.data.train), c.batch_per_gpu * world, c.seed), 0, []
        src, tgt = self.data.train.lengths()
        sampler: TokenBuckets | ShapeBuckets
        if c.pad_multiple > 1:
            src_w, tgt_w = (
                round_up(side, c.pad_multiple, c.model.max_len) for side in side_costs(src, tgt, c.model.max_len)
            )
            costs = np.maximum(src_w, tgt_w)
            budget = token_budget(c.batch_per_gpu, costs, c.max_tokens)
            sampler = ShapeBuckets(src_w, tgt_w, budget, c.seed)
            how = f"lengths to a multiple of {c.pad_multiple} in {len(sampler.classes)} classes"
        else:
            costs = pair_costs(src, tgt, c.model.max_len)
            budget = token_budget(c.batch_per_gpu, costs, c.max_tokens)
            key = (costs * (c.model.max_len + 1) + np.minimum(src, c.model.max_len)) * (c.model.max_len + 1)
            sampler = TokenBuckets(costs, key + np.minimum(tgt, c.model.max_len), budget, c.seed)
            how = f"sorted by length within chunks of {sampler.chunk} pairs"
        source = (
            f"--max-tokens {c.max_tokens}"
            if c.max_tokens
            else (f"--batch-per-gpu {c.batch_per_gpu} x {costs.mean():.1f} mean tokens per pair")
        )
        count = len(sampler.epoch(0))
        note = f"batches: up to {budget} tokens per micro-batch ({source}), {how}; {count} batches in epoch 0"
        return sampler, budget, [note]

    def _host_batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        """This rank's micro-batches of `step`, on the host (pinned for an asynchronous copy to a GPU)."""
        c, world, rank = self.config, self.info.world_size, self.info.rank
        out = []
        for micro in range(c.grad_accum):
            if isinstance(self.sampler, (TokenBuckets, ShapeBuckets)):
                bucket = self.sampler.bucket((step * world + rank) * c.grad_accum + micro)
                widths = self.sampler.widths_of(bucket) if isinstance(self.sampler, ShapeBuckets) else (0, 0)
                batch = self.data.train.batch(bucket, widths)
            else:
                batch = self.data.train.batch(
                    rank_slice(self.sampler.indices(step * c.grad_accum + micro), rank, world)
                )
            out.append(tuple(t.pin_memory() for t in batch) if self.device.type == "cuda" else batch)
        return out

    def shape_batches(self, step: int, limit: int) -> list[tuple[torch.Tensor, ...]]:
        """A micro-batch of each of the `limit` commonest shapes of the epoch `step` trains in, on the
        device (the trainer runs each once before the step: perf.warm_shapes). Shape classes only
        (--pad-multiple > 1): padded to the longest, token batches take too many shapes to cover."""
        if not isinstance(self.sampler, ShapeBuckets) or limit <= 0:
            return []
        position = step * self.info.world_size * self.config.grad_accum
        buckets = self.sampler.commonest(position, limit)
        batches = [self.data.train.batch(b, self.sampler.widths_of(b)) for b in buckets]
        return [tuple(t.to(self.device) for t in batch) for batch in batches]

    def _prepared(self, step: int) -> tuple[list[tuple[torch.Tensor, ...]], list]:
        """The host batches and, counted on the loader's thread, each one's (shape, pads, tokens)."""
        batches = self._host_batches(step)
        records = []
        for src, tgt_in, tgt_out in batches:
            pads = int(src.eq(PAD).sum()) + int(tgt_out.eq(PAD).sum())
            records.append(((len(src), src.size(1), tgt_in.size(1)), pads, src.numel() + tgt_out.numel()))
        return batches, records

    def optimizer(self) -> torch.optim.Optimizer:
        c = self.config
        # Fused on a GPU: one kernel for all parameters (the per-tensor loop costs ~4 ms of CPU a step).
        fused = True if self.device.type == "cuda" else None
        return torch.optim.Adam(self.model.parameters(), lr=1.0, betas=tuple(c.adam_betas), eps=c.adam_eps, fused=fused)

    def lr_factor(self, step: int) -> float:
        c = self.config
        return transformer_lr(step, c.model.d_model, c.warmup_steps, c.lr_scale)

    def batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        """Built one step ahead on a thread (sampler.Prefetcher); copied without blocking."""
        batches, records = self.loader.get(step)
        self.shapes.add(records)
        return [tuple(t.to(self.device, non_blocking=True) for t in batch) for batch in batches]

    def flops(self, batch) -> int:
        m = self.config.model
        src, tgt_in = batch[0], batch[1]
        return transformer_flops(m.d_model, m.ffn, m.layers, self.vocab, src.size(0), src.size(1), tgt_in.size(1))

    def units(self, batch) -> torch.Tensor:
        return batch[2].ne(PAD).sum()  # target tokens, counted on the device

    def loss_sum(self, module, batch) -> torch.Tensor:
        src, tgt_in, tgt_out = batch
        return F.cross_entropy(
            module(src, tgt_in).float().flatten(0, 1),
            tgt_out.flatten(),
            ignore_index=PAD,
            label_smoothing=self.config.label_smoothing,
            reduction="sum",
        )

    def evaluate(self) -> dict:
        from train.evaluate import evaluate

        return evaluate(self.model, self.data, self.config, self.info, self.device)

    def checkpoint_extras(self) -> dict:
        return {"vocabulary": str(Path(self.data.tokenizer.path).resolve())}


class ImageTask:
    objects = "images"
    metric = "top1"

    def __init__(self, config: TrainConfig, info: distributed.DistInfo, device: torch.device):
        from train.imagepipe import TrainStream, workers_for
        from train.vision import ImageFolder, ResNet

        self.config, self.info, self.device = config, info, device
        v = config.vision
        # Decoded in worker processes into pinned memory, normalised on the device (imagepipe.py).
        self.workers, self.pin = workers_for(v.workers), device.type == "cuda"
        if not v.synthetic:
            self.train = ImageFolder(Path(config.data) / "train")
            self.val = ImageFolder(Path(config.data) / "val", classes=self.train.classes)
            v.num_classes = len(self.train.classes)
            self.stream = TrainStream(
                self.train, v.image_size, config.batch_per_gpu, info.world_size, info.rank, config.seed
            )
            self.stream.configure(self.workers, self.pin)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed image shapes: cuDNN's autotuned kernels pay
        torch.manual_seed(config.seed)
        self.model = ResNet(v.arch, v.num_classes, v.width)
        self.model.to(device, memory_format=torch.channels_last)  # type: ignore[call-overload]  # not in the stub
        # Under autocast the first convolution runs in the AMP dtype: hand it that dtype (half the bytes).
        amp = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.precision)
        self.input_dtype = amp if amp is not None and device.type == "cuda" else torch.float32
        self._eval_loader = None
        self._synthetic: tuple[torch.Tensor, torch.Tensor] | None = None
        self.image_flops = 3 * resnet_forward_flops(self.model, v.image_size)

    def optimizer(self) -> torch.optim.Optimizer:
        v = self.config.vision
        decay = [p for n, p in self.model.named_parameters() if p.ndim > 1]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim <= 1]  # BN and biases
        groups = [{"params": decay, "weight_decay": v.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = True if self.device.type == "cuda" else None  # and no host read of GradScaler's inf check
        return momentum_sgd(groups, v.momentum, fused)

    def lr_factor(self, step: int) -> float:
        c = self.config
        global_batch = c.global_batch(self.info.world_size)
        return warmup_cosine_lr(step, c.warmup_steps, c.max_steps, c.vision.base_lr * global_batch / 256)

    def batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        from train.imagepipe import to_device

        c = self.config
        out: list[tuple[torch.Tensor, ...]] = []
        for micro in range(c.grad_accum):
            if c.vision.synthetic:
                out.append(self._synthetic_batch())
                continue
            batch = self.stream.get(step * c.grad_accum + micro)
            out.append(to_device(batch, self.device, self.input_dtype))
        return out

    def _synthetic_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fixed random data for throughput benchmarks without a data set: made once, on the device,
        and reused by every micro-batch of every step."""
        if self._synthetic is None:
            c, v = self.config, self.config.vision
            generator = torch.Generator(device=self.device).manual_seed(c.seed + self.info.rank)
            images = torch.randn(
                c.batch_per_gpu, 3, v.image_size, v.image_size, generator=generator, device=self.device
            )
            labels = torch.randint(0, v.num_classes, (c.batch_per_gpu,), generator=generator, device=self.device)
            self._synthetic = (images.contiguous(memory_format=torch.channels_last), labels)
        return self._synthetic

    def units(self, batch) -> int:
        return int(batch[1].numel())

    def flops(self, batch) -> int:
        return self.image_flops * len(batch[1])

    def loss_sum(self, module, batch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(
            module(images).float(), labels, label_smoothing=self.config.label_smoothing, reduction="sum"
        )

    @torch.no_grad()
    def evaluate(self) -> dict:
        from train.imagepipe import to_device

        c = self.config
        if c.vision.synthetic:
            return {"eval_loss": None, "top1": None, "top5": None}
        self.model.eval()
        totals = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss, top1, top5, images
        for batch in self._val_loader():
            images, labels = to_device(batch, self.device)
            logits = self.model(images).float()
            top5 = logits.topk(min(5, logits.size(1)), dim=1).indices
            totals[0] += F.cross_entropy(logits, labels, reduction="sum")
            totals[1] += top5[:, 0].eq(labels).sum()
            totals[2] += top5.eq(labels[:, None]).any(1).sum()
            totals[3] += len(labels)
        loss, top1, top5, images_seen = distributed.all_reduce_sum(totals).tolist()
        images_seen = max(images_seen, 1.0)
        return {"eval_loss": loss / images_seen, "top1": 100 * top1 / images_seen, "top5": 100 * top5 / images_seen}

    def _val_loader(self):
        """This rank's share of the eval subset, decoded by its own persistent workers (kept between
        evaluations: the subset is the same each time)."""
        from train.imagepipe import Samples, loader

        if self._eval_loader is None:
            c = self.config
            mine = eval_indices(c.eval_samples, len(self.val))[self.info.rank :: self.info.world_size]
            keys = [[(i, 0) for i in mine[start : start + c.eval_batch]] for start in range(0, len(mine), c.eval_batch)]
            samples = Samples(self.val, c.vision.image_size, train=False)
            self._eval_loader = loader(samples, keys, self.workers, self.pin, c.seed)
        return self._eval_loader

    def checkpoint_extras(self) -> dict:
        return {"classes": getattr(self, "train", None) and self.train.classes}


def momentum_sgd(groups: list[dict], momentum: float, fused: bool | None) -> torch.optim.SGD:
    """SGD with its momentum buffers made up front, as zeros (checkpoint.settle_optimizer_state says why)."""
    optimizer = torch.optim.SGD(groups, lr=1.0, momentum=momentum, nesterov=False, fused=fused)
    checkpoint.settle_optimizer_state(optimizer)
    return optimizer


def eval_indices(count: int, total: int) -> list[int]:
    """`count` images spread evenly over the val set: its files are sorted by class, so its first
    `count` would hold the first classes only."""
    if count >= total:
        return list(range(total))
    return [i * total // count for i in range(count)]


def make_task(config: TrainConfig, info: distributed.DistInfo, device: torch.device):
    return (ImageTask if config.task == "image" else TranslationTask)(config, info, device)
