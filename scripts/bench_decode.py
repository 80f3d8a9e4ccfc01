#!/usr/bin/env python3
"""The image pipeline's CPU per image in a DataLoader worker, before and after (issue 29: on one H200
the 15 decode workers gave ~4,400 images a second where fp16 ResNet-50 asks for ~5,950).

    .venv/bin/python scripts/bench_decode.py [--images 512] [--rounds 3] [--batch 64]

`before` is the path to session 27, reimplemented here: each image decoded in full into a tensor of
its own, the batch stacked by the collate function, and that batch copied into shared memory to
cross the worker's queue. `after` is the trainer's own (imagepipe.Samples): the batch allocated in
shared memory and each image decoded straight into its slot, a JPEG larger than its crop needs
decoded at 1/2, 1/4 or 1/8 scale. One worker process per measurement; its CPU time (user + system,
read when it has exited) per image, train (RandomResizedCrop + flip) and eval (resize + centre crop)
to 224 px, on generated photo-like JPEGs of ImageNet's typical size (~500x375) and of a camera's
(~2000x1500). Rounds alternate before and after (this machine is noisy); medians are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import gpu_jpegs  # beside this script: its directory is the script's sys.path[0]
import torch
from torch.utils.data import DataLoader

from train.imagepipe import Samples, collate
from train.vision import ImageFolder, _random_resized_crop

SIZE = 224


def old_decode(path: str, size: int, train: bool, seed: int) -> torch.Tensor:
    """vision.decode before issue 29's pipeline work: a full decode, then bytes copied twice."""
    import random

    from PIL import Image

    with Image.open(path) as source:
        image = source if source.mode == "RGB" else source.convert("RGB")
        if train:
            rng = random.Random(seed)
            image = image.resize((size, size), Image.Resampling.BILINEAR, box=_random_resized_crop(*image.size, rng))
            if rng.random() < 0.5:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        else:
            scale = size / 0.875 / min(image.size)
            image = image.resize(
                (max(size, round(image.width * scale)), max(size, round(image.height * scale))),
                Image.Resampling.BILINEAR,
            )
            left, top = (image.width - size) // 2, (image.height - size) // 2
            image = image.crop((left, top, left + size, top + size))
        return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(size, size, 3)


class OldSamples(torch.utils.data.Dataset):
    def __init__(self, folder: ImageFolder, size: int, train: bool):
        self.folder, self.size, self.train = folder, size, train

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, key):
        index, seed = key
        path, label = self.folder.samples[index]
        return old_decode(path, self.size, self.train, seed), label


def old_collate(samples):
    return torch.stack([image for image, _ in samples]), torch.tensor([label for _, label in samples])


def worker_cpu_per_image(samples, collate_fn, images: int, batch: int) -> float:
    """Milliseconds of one worker process's CPU per image, over `images` images."""
    keys = [[(i % len(samples), 7919 * i) for i in range(start, start + batch)] for start in range(0, images, batch)]
    before = os.times()
    for _ in DataLoader(samples, batch_sampler=keys, num_workers=1, collate_fn=collate_fn):
        pass  # the iterator joins its worker at the end: its CPU is then in os.times()' children
    after = os.times()
    spent = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return 1000 * spent / (len(keys) * batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=512, help="images per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, scale in (("~500x375", 1.0), ("~2000x1500", 4.0)):
            root = Path(tmp) / name
            gpu_jpegs.main([str(root), "4", str(max(2, min(args.images, 128) // 4)), str(scale)])
            for split, train in (("train", True), ("eval", False)):
                folder = ImageFolder(root / "train")
                paths = {"before": (OldSamples(folder, SIZE, train), old_collate)}
                paths["after"] = (Samples(folder, SIZE, train), collate)
                times: dict[str, list[float]] = {label: [] for label in paths}
                for _ in range(args.rounds):
                    for label, (samples, collate_fn) in paths.items():
                        times[label].append(worker_cpu_per_image(samples, collate_fn, args.images, args.batch))
                rows.append((name, split, statistics.median(times["before"]), statistics.median(times["after"])))
    print(f"\nCPU of one decode worker per image, {SIZE} px, batches of {args.batch}, median of {args.rounds} rounds")
    print("| JPEGs | augmentation | before | after | after / before | images/s per worker, after |")
    print("|---|---|---|---|---|---|")
    for name, split, before, after in rows:
        print(f"| {name} | {split} | {before:.2f} ms | {after:.2f} ms | {after / before:.2f}x | {1000 / after:.0f} |")


if __name__ == "__main__":
    main()
