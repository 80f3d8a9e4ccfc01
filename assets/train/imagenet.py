"""Check an ImageNet folder (the standard train/ and val/ class-folder layout) and optionally stage it
onto local disk (e.g. the node's NVMe), since EFS can be too slow to feed image training.
Staging is resumable: files already copied with the same size are skipped."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png"}


class LayoutError(ValueError):
    pass


def scan(root: Path) -> dict:
    """Classes and image counts per split; a one-line LayoutError for the usual mistakes."""
    if not root.is_dir():
        raise LayoutError(f"{root} is not a directory")
    result = {}
    for split in ("train", "val"):
        directory = root / split
        if not directory.is_dir():
            raise LayoutError(f"{root} has no {split}/ directory (expected {split}/CLASS/IMAGE.JPEG)")
        loose = [p for p in directory.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
        if loose:
            raise LayoutError(
                f"{directory} holds {len(loose)} images directly: sort them into one "
                "folder per class (the val ground-truth script does this)"
            )
        classes = sorted(p.name for p in directory.iterdir() if p.is_dir())
        counts = {c: sum(1 for f in (directory / c).iterdir() if f.suffix.lower() in IMAGE_SUFFIXES) for c in classes}
        empty = [c for c, n in counts.items() if n == 0]
        if not classes or empty:
            raise LayoutError(f"{directory}: {len(classes)} class folders, {len(empty)} without images")
        result[split] = {"classes": len(classes), "images": sum(counts.values()), "class_names": classes}
    if result["train"]["class_names"] != result["val"]["class_names"]:
        raise LayoutError(f"{root}: train/ and val/ have different class folders")
    return result


def stage(source: Path, target: Path, log=print) -> tuple[int, int]:
    """Copy source to target (atomic per file), skipping files already there with the same size."""
    copied = skipped = 0
    for directory, _, files in os.walk(source):
        relative = Path(directory).relative_to(source)
        (target / relative).mkdir(parents=True, exist_ok=True)
        for name in files:
            src, dst = Path(directory) / name, target / relative / name
            if dst.exists() and dst.stat().st_size == src.stat().st_size:
                skipped += 1
                continue
            tmp = dst.with_name(f".{name}.tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
            copied += 1
            if copied % 10_000 == 0:
                log(f"  staged {copied} files")
    return copied, skipped
