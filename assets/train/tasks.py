"""What differs between recipes, behind one small interface the trainer drives:
model, this rank's micro-batches for a step (a fixed function of seed and step), summed loss and the
units it is normalised by, optimizer, LR schedule, evaluation."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

import distributed
from config import TrainConfig
from data import DataSet, PAD, global_batch_indices, rank_slice


def transformer_lr(step: int, d_model: int, warmup: int, scale: float) -> float:
    """scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step counted from 1."""
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def warmup_cosine_lr(step: int, warmup: int, total: int, peak: float) -> float:
    """Linear warm-up to `peak`, then cosine decay to 0 at `total`; step counted from 1."""
    if step <= warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


class TranslationTask:
    objects = "sentence pairs"
    metric = "bleu"

    def __init__(self, config: TrainConfig, info: distributed.DistInfo, device: torch.device):
        from model import Transformer
        self.config, self.info, self.device = config, info, device
        self.data = DataSet(config.data, config.model.max_len)
        torch.manual_seed(config.seed)  # the same initial weights for any world size
        self.model = Transformer(config.model, self.data.tokenizer.vocab_size).to(device)

    def optimizer(self) -> torch.optim.Optimizer:
        c = self.config
        return torch.optim.Adam(self.model.parameters(), lr=1.0, betas=tuple(c.adam_betas), eps=c.adam_eps)

    def lr_factor(self, step: int) -> float:
        c = self.config
        return transformer_lr(step, c.model.d_model, c.warmup_steps, c.lr_scale)

    def batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        c, world = self.config, self.info.world_size
        out = []
        for micro in range(c.grad_accum):
            indices = global_batch_indices(step * c.grad_accum + micro, c.batch_per_gpu * world,
                                           len(self.data.train), c.seed)
            mine = rank_slice(indices, self.info.rank, world)
            out.append(tuple(t.to(self.device) for t in self.data.train.batch(mine)))
        return out

    def units(self, batch) -> int:
        return int(batch[2].ne(PAD).sum())  # target tokens

    def loss_sum(self, module, batch) -> torch.Tensor:
        src, tgt_in, tgt_out = batch
        return F.cross_entropy(module(src, tgt_in).float().flatten(0, 1), tgt_out.flatten(),
                               ignore_index=PAD, label_smoothing=self.config.label_smoothing, reduction="sum")

    def evaluate(self) -> dict:
        from evaluate import evaluate
        return evaluate(self.model, self.data, self.config, self.info, self.device)

    def checkpoint_extras(self) -> dict:
        return {"vocabulary": str(Path(self.data.tokenizer.path).resolve())}


class ImageTask:
    objects = "images"
    metric = "top1"

    def __init__(self, config: TrainConfig, info: distributed.DistInfo, device: torch.device):
        from vision import ImageFolder, ResNet
        self.config, self.info, self.device = config, info, device
        v = config.vision
        if not v.synthetic:
            self.train = ImageFolder(Path(config.data) / "train")
            self.val = ImageFolder(Path(config.data) / "val", classes=self.train.classes)
            v.num_classes = len(self.train.classes)
        torch.manual_seed(config.seed)
        self.model = ResNet(v.arch, v.num_classes, v.width).to(device, memory_format=torch.channels_last)
        self.pool = ThreadPoolExecutor(max_workers=v.workers)

    def optimizer(self) -> torch.optim.Optimizer:
        v = self.config.vision
        decay = [p for n, p in self.model.named_parameters() if p.ndim > 1]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim <= 1]  # BN and biases
        return torch.optim.SGD([{"params": decay, "weight_decay": v.weight_decay},
                                {"params": no_decay, "weight_decay": 0.0}],
                               lr=1.0, momentum=v.momentum, nesterov=False)

    def lr_factor(self, step: int) -> float:
        c = self.config
        global_batch = c.batch_per_gpu * self.info.world_size * c.grad_accum
        return warmup_cosine_lr(step, c.warmup_steps, c.max_steps, c.vision.base_lr * global_batch / 256)

    def batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        from vision import load_batch
        c, v, world = self.config, self.config.vision, self.info.world_size
        out = []
        for micro in range(c.grad_accum):
            position = step * c.grad_accum + micro
            if v.synthetic:  # fixed random data: throughput benchmarks without a data set
                generator = torch.Generator().manual_seed(c.seed + self.info.rank)
                images = torch.randn(c.batch_per_gpu, 3, v.image_size, v.image_size, generator=generator)
                labels = torch.randint(0, v.num_classes, (c.batch_per_gpu,), generator=generator)
                images = images.contiguous(memory_format=torch.channels_last)
            else:
                indices = global_batch_indices(position, c.batch_per_gpu * world, len(self.train), c.seed)
                images, labels = load_batch(self.train, rank_slice(indices, self.info.rank, world),
                                            v.image_size, True, c.seed * 7919 + position, self.pool)
            out.append((images.to(self.device), labels.to(self.device)))
        return out

    def units(self, batch) -> int:
        return int(batch[1].numel())

    def loss_sum(self, module, batch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(module(images).float(), labels, label_smoothing=self.config.label_smoothing,
                               reduction="sum")

    @torch.no_grad()
    def evaluate(self) -> dict:
        from vision import load_batch
        c = self.config
        if c.vision.synthetic:
            return {"eval_loss": None, "top1": None, "top5": None}
        self.model.eval()
        count = min(c.eval_samples, len(self.val))
        mine = list(range(self.info.rank, count, self.info.world_size))
        totals = torch.zeros(4, dtype=torch.float64)  # loss, top1, top5, images
        for start in range(0, len(mine), c.eval_batch):
            images, labels = load_batch(self.val, mine[start:start + c.eval_batch], c.vision.image_size,
                                        False, 0, self.pool)
            logits = self.model(images.to(self.device)).float()
            labels = labels.to(self.device)
            top5 = logits.topk(min(5, logits.size(1)), dim=1).indices
            totals += torch.tensor([F.cross_entropy(logits, labels, reduction="sum").item(),
                                    top5[:, 0].eq(labels).sum().item(),
                                    top5.eq(labels[:, None]).any(1).sum().item(), len(labels)],
                                   dtype=torch.float64)
        distributed.all_reduce_sum(totals)
        images_seen = max(totals[3].item(), 1.0)
        return {"eval_loss": totals[0].item() / images_seen, "top1": 100 * totals[1].item() / images_seen,
                "top5": 100 * totals[2].item() / images_seen}

    def checkpoint_extras(self) -> dict:
        return {"classes": getattr(self, "train", None) and self.train.classes}


def make_task(config: TrainConfig, info: distributed.DistInfo, device: torch.device):
    return (ImageTask if config.task == "image" else TranslationTask)(config, info, device)
