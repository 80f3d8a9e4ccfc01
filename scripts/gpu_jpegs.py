"""ImageNet-like JPEGs for scripts/bench_gpu.py (../shared/gpu/makejpegs.py's images): about 500x375
(times SCALE), smooth content so sizes and decode times are realistic, in train/ and val/ class folders.

    python3 scripts/gpu_jpegs.py ROOT CLASSES PER_CLASS [SCALE]
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np


def _jpeg(job: tuple) -> None:
    from PIL import Image

    root, split, c, i, scale = job
    rng = np.random.default_rng(c * 100003 + i)
    w, h = int(rng.integers(400, 560) * scale), int(rng.integers(300, 420) * scale)
    base = rng.integers(0, 255, (max(1, h // 8), max(1, w // 8), 3), dtype=np.uint8)
    image = Image.fromarray(base).resize((w, h), Image.Resampling.BICUBIC)
    noise = rng.integers(-12, 12, (h, w, 3))
    pixels = np.clip(np.asarray(image, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
    folder = os.path.join(root, split, f"n{c:08d}")
    os.makedirs(folder, exist_ok=True)
    Image.fromarray(pixels).save(os.path.join(folder, f"{split}_{i}.JPEG"), quality=90)


def main(argv: list[str]) -> None:
    root, classes, per_class = argv[0], int(argv[1]), int(argv[2])
    scale = float(argv[3]) if len(argv) > 3 else 1.0
    jobs = [(root, "train", c, i, scale) for c in range(classes) for i in range(per_class)]
    jobs += [(root, "val", c, i, scale) for c in range(classes) for i in range(2)]
    with ProcessPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(_jpeg, jobs, chunksize=32))


if __name__ == "__main__":
    main(sys.argv[1:])
