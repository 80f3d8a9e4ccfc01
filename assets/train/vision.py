"""ResNet (He et al. 2016, torchvision's layout and parameter count), the ImageNet folder and its
deterministic per-sample augmentation (RandomResizedCrop + flip) decoded by PIL in uint8; the
DataLoader pipeline around it is imagepipe.py."""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
SUFFIXES = {".jpeg", ".jpg", ".png"}


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


ARCHS: dict[str, tuple[type[BasicBlock] | type[Bottleneck], list[int]]] = {
    "resnet18": (BasicBlock, [2, 2, 2, 2]),
    "resnet34": (BasicBlock, [3, 4, 6, 3]),
    "resnet50": (Bottleneck, [3, 4, 6, 3]),
    "resnet101": (Bottleneck, [3, 4, 23, 3]),
}


class ResNet(nn.Module):
    def __init__(self, arch: str, num_classes: int, width: int = 64):
        super().__init__()
        block, layers = ARCHS[arch]
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._layer(block, width, layers[0], 1)
        self.layer2 = self._layer(block, width * 2, layers[1], 2)
        self.layer3 = self._layer(block, width * 4, layers[2], 2)
        self.layer4 = self._layer(block, width * 8, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        for module in self.modules():  # zero-init the last BN of each block (Goyal et al.)
            if isinstance(module, (Bottleneck, BasicBlock)):
                nn.init.zeros_((module.bn3 if isinstance(module, Bottleneck) else module.bn2).weight)

    def _layer(self, block, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride, bias=False),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ImageFolder:
    """ROOT/CLASS/IMAGE files, classes sorted by name (the torchvision convention)."""

    def __init__(self, root: str | Path, classes: Sequence[str] | None = None):
        root = Path(root)
        if not root.is_dir():
            raise FileNotFoundError(
                f"no image folder {root}: prepare one with `python -m train.prepare fashion-mnist --out DATA` "
                "(fab data --dataset fashion-mnist) or check yours with `python -m train.prepare imagenet --source DIR`"
            )
        self.classes = list(classes) if classes else sorted(p.name for p in root.iterdir() if p.is_dir())
        index = {name: i for i, name in enumerate(self.classes)}
        self.samples = sorted(
            (str(p), index[p.parent.name])
            for name in self.classes
            for p in (root / name).iterdir()
            if p.suffix.lower() in SUFFIXES
        )
        if not self.samples:
            raise FileNotFoundError(f"no images under {root}")

    def __len__(self) -> int:
        return len(self.samples)


def _random_resized_crop(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop box: scale (0.08, 1), ratio (3/4, 4/3), 10 tries, then centre."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.randint(0, width - w), rng.randint(0, height - h)
            return left, top, left + w, top + h
    side = min(width, height)
    return (width - side) // 2, (height - side) // 2, (width + side) // 2, (height + side) // 2


def decoded(path: str, size: int, train: bool, seed: int):
    """One image as a size x size RGB PIL image: train, the seeded RandomResizedCrop box resized and a
    seeded flip; eval, the short side resized to size/0.875 and the centre crop. All in uint8 (PIL).
    A JPEG larger than the output needs is decoded at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling,
    PIL's draft): never below the size the box is resized to, at a quarter of the work or less."""
    from PIL import Image

    with Image.open(path) as source:
        width, height = source.size
        if train:
            rng = random.Random(seed)
            box = _random_resized_crop(width, height, rng)
            k = _draft(source, width * size / (box[2] - box[0]), height * size / (box[3] - box[1]))
            image = _rgb(source).resize((size, size), Image.Resampling.BILINEAR, box=tuple(v * k for v in box))
            if rng.random() < 0.5:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            return image
        scale = size / 0.875 / min(width, height)
        target = (max(size, round(width * scale)), max(size, round(height * scale)))
        k = _draft(source, width * scale, height * scale)
        image = _rgb(source).resize(target, Image.Resampling.BILINEAR, box=(0, 0, width * k, height * k))
        left, top = (image.width - size) // 2, (image.height - size) // 2
        return image.crop((left, top, left + size, top + size))


def _draft(source, width: float, height: float) -> float:
    """Decode no smaller than width x height; the scale it decodes at (1: a PNG, or the full size). A
    scaled decode is ceil(W / s) pixels wide, its last column partly padding: the image's own extent in it
    is the box draft returns, W / s (PIL's JpegImagePlugin.draft), not the decoded width."""
    full = source.size[0]
    found = source.draft(None, (math.ceil(width), math.ceil(height)))
    return found[1][2] / full if found else 1.0


def _rgb(image):
    return image if image.mode == "RGB" else image.convert("RGB")  # a JPEG's decode is RGB: no copy


def decode_into(slot: np.ndarray, path: str, size: int, train: bool, seed: int) -> None:
    """decoded() written into a (size, size, 3) uint8 slot of a batch: one copy of the pixels."""
    slot[...] = np.frombuffer(decoded(path, size, train, seed).tobytes(), dtype=np.uint8).reshape(slot.shape)


def decode(path: str, size: int, train: bool, seed: int) -> torch.Tensor:
    """decoded() as a uint8 HWC tensor of its own."""
    image = torch.empty(size, size, 3, dtype=torch.uint8)
    decode_into(image.numpy(), path, size, train, seed)
    return image


def load_image(path: str, size: int, train: bool, seed: int) -> torch.Tensor:
    """decode(), normalised as float32 CHW on the host: the pipeline before issue 21 §3, kept for
    scripts/bench_train_loop.py's "before" column (and as a readable reference)."""
    return (decode(path, size, train, seed).permute(2, 0, 1).float() / 255.0 - MEAN) / STD


def load_batch(
    folder: ImageFolder, indices: Sequence[int], size: int, train: bool, seed: int, pool: ThreadPoolExecutor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The synchronous float32 host batch (before issue 21 §3); the trainer uses imagepipe.py."""
    images = list(pool.map(lambda i: load_image(folder.samples[i][0], size, train, seed * 1_000_003 + i), indices))
    labels = torch.tensor([folder.samples[i][1] for i in indices])
    return torch.stack(images).contiguous(memory_format=torch.channels_last), labels
