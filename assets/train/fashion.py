"""Real images from Debian's `dataset-fashion-mnist` package (Zalando's Fashion-MNIST, MIT/Expat:
70,000 28x28 grayscale product photos in 10 classes), written out as an ImageFolder of JPEGs so that
the ImageNet recipe's own loader (vision.py: JPEG decode, random-resized crop, flip, resize and
centre crop for eval) reads them. The images are read from the installed package at preparation
time: none is part of this repository.

The package ships the four gzipped IDX files of the original release (README's "Get the Data"):
train-* (60,000) and t10k-* (10,000, the held-out test set), which become train/ and val/. IDX
(http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT"): a big-endian magic `00 00 08 NDIM`
(0x08 = unsigned bytes), NDIM big-endian int32 sizes, then the data in C order.

Layout: OUT/{train,val}/{label}-{name}/{index:05d}.jpg, `index` the image's position in its IDX
file. Class folders start with the label digit, so ImageFolder's sorted class order is the
dataset's own label order (0 T-shirt/top ... 9 Ankle boot). A subset takes the first N images of
each class in file order: deterministic, balanced, and a prefix of any larger subset.
"""

from __future__ import annotations

import gzip
import io
import shutil
import struct
from pathlib import Path
from typing import Iterator

PACKAGE = "dataset-fashion-mnist"
PATH = Path("/usr/share/datasets/fashion-mnist")
CHANGELOG = Path("/usr/share/doc/dataset-fashion-mnist/changelog.Debian.gz")
INSTALL = f"apt-get install {PACKAGE}"
# The package README's label table, in label order; folder names need no '/'.
CLASSES = ("t-shirt-top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle-boot")
FOLDERS = tuple(f"{label}-{name}" for label, name in enumerate(CLASSES))
SPLITS = {"train": "train", "val": "t10k"}  # our split -> the package's file prefix
SIDE = 28
JPEG_QUALITY = 95


class MissingPackage(FileNotFoundError):
    pass


class FormatError(ValueError):
    pass


def require(root: Path = PATH) -> Path:
    missing = [
        name
        for prefix in SPLITS.values()
        for kind in ("images-idx3", "labels-idx1")
        if not (root / (name := f"{prefix}-{kind}-ubyte.gz")).is_file()
    ]
    if missing:
        raise MissingPackage(
            f"{root / missing[0]} not found: the fashion-mnist data set needs Debian's {PACKAGE} package "
            f"(`apt-get update && {INSTALL}`, or scripts/setup.sh)"
        )
    return root


def version(root: Path = PATH, changelog: Path = CHANGELOG) -> str:
    """The package version (first changelog line), recorded in meta.json; 'unknown' without it."""
    require(root)
    if not changelog.is_file():
        return "unknown"
    with gzip.open(changelog, "rt", encoding="utf-8") as handle:
        first = handle.readline()
    return first.split("(", 1)[1].split(")", 1)[0] if "(" in first else "unknown"


def read_idx(path: Path, ndim: int) -> tuple[tuple[int, ...], bytes]:
    """(sizes, data) of a gzipped unsigned-byte IDX file with `ndim` dimensions."""
    with gzip.open(path, "rb") as handle:
        raw = handle.read()
    if len(raw) < 4 + 4 * ndim or raw[:4] != bytes((0, 0, 0x08, ndim)):
        raise FormatError(f"{path}: not an unsigned-byte IDX file with {ndim} dimension(s) (magic {raw[:4].hex()})")
    sizes = struct.unpack(f">{ndim}i", raw[4 : 4 + 4 * ndim])
    data = raw[4 + 4 * ndim :]
    expected = 1
    for size in sizes:
        expected *= size
    if len(data) != expected:
        raise FormatError(f"{path}: {len(data)} data bytes, its header says {expected}")
    return sizes, data


def load_split(root: Path, split: str) -> tuple[bytes, bytes]:
    """(pixels, labels) of one split: count*28*28 bytes, and count labels in 0..9."""
    prefix = SPLITS[split]
    (count, rows, cols), pixels = read_idx(root / f"{prefix}-images-idx3-ubyte.gz", 3)
    (label_count,), labels = read_idx(root / f"{prefix}-labels-idx1-ubyte.gz", 1)
    if (rows, cols) != (SIDE, SIDE) or label_count != count:
        raise FormatError(f"{root}: {prefix} holds {count} {rows}x{cols} images and {label_count} labels")
    if max(labels) >= len(CLASSES):
        raise FormatError(f"{root}: {prefix} has label {max(labels)}, expected 0..{len(CLASSES) - 1}")
    return pixels, labels


def select(labels: bytes, per_class: int | None) -> list[int]:
    """Indices of the first `per_class` images of each class (all with None), in file order."""
    taken = [0] * len(CLASSES)
    chosen = []
    for index, label in enumerate(labels):
        if per_class is None or taken[label] < per_class:
            taken[label] += 1
            chosen.append(index)
    return chosen


def jpeg(pixels: bytes, index: int) -> bytes:
    from PIL import Image

    image = Image.frombytes("L", (SIDE, SIDE), pixels[index * SIDE * SIDE : (index + 1) * SIDE * SIDE])
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


def images(root: Path, split: str, per_class: int | None) -> Iterator[tuple[str, bytes]]:
    """(relative path, JPEG bytes) of the selected images of a split."""
    pixels, labels = load_split(root, split)
    for index in select(labels, per_class):
        yield f"{split}/{FOLDERS[labels[index]]}/{index:05d}.jpg", jpeg(pixels, index)


def write(out: Path, root: Path, per_class: dict[str, int | None], every: int = 15_000) -> dict[str, int]:
    """Build train/ and val/ in a scratch directory beside them, then swap them in: a run that
    stops half-way leaves the previous folders (or none) and no half-written split. Says every `every`
    images how far it is (all 70,000 take ~11 s on the emulated cluster)."""
    scratch = out / ".building"
    shutil.rmtree(scratch, ignore_errors=True)
    counts = {}
    for split in SPLITS:
        for folder in FOLDERS:
            (scratch / split / folder).mkdir(parents=True)
        counts[split] = 0
        for relative, data in images(root, split, per_class[split]):
            (scratch / relative).write_bytes(data)
            counts[split] += 1
            if counts[split] % every == 0:
                print(f"  {split}: {counts[split]} images written", flush=True)
    for split in SPLITS:
        old = out / f".old-{split}"
        shutil.rmtree(old, ignore_errors=True)
        if (out / split).exists():
            (out / split).rename(old)
        (scratch / split).rename(out / split)
        shutil.rmtree(old, ignore_errors=True)
    scratch.rmdir()
    return counts
