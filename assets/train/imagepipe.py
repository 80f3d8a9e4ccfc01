"""The image input pipeline: JPEG decode and crop/flip/resize in uint8 in DataLoader worker processes,
each batch decoded straight into shared memory, prefetched into pinned host memory, copied with
non_blocking=True, normalised on the device.

Why torch DataLoader workers and not NVIDIA DALI: DALI is preinstalled in NGC's PyTorch containers
(docs.nvidia.com/deeplearning/dali/user-guide/docs/installation.html, "DALI in NGC Containers"), but it
needs a GPU, so the CPU tests here could not run the pipeline the cluster runs; its random operators
draw from per-pipeline state, so a resume mid-epoch would not see the same crops without rebuilding
that state; and nvJPEG decoding takes GPU time from small GPUs (T4) the recipes also target. With
workers, every augmentation is a fixed function of (seed, position in the run, sample), decoded in
whichever worker: the batches after a resume are those of a run that never stopped."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from train.data import rank_slice
from train.sampler import SentenceBatches
from train.vision import MEAN, STD, ImageFolder, decode_into

# Batches each worker keeps decoded ahead of the step (DataLoader's prefetch_factor; 2 is its default).
PREFETCH = 2
AUTO = -1  # --workers -1: from the node's CPUs and the ranks on the node


def workers_for(requested: int, env: Mapping[str, str] | None = None) -> int:
    """Decode processes per rank: `requested`, or for AUTO the CPUs this process may use divided by
    the ranks on the node (torchrun's LOCAL_WORLD_SIZE, Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE), less
    one for the rank itself, at least one."""
    if requested != AUTO:
        return requested
    env = os.environ if env is None else env
    local = int(env.get("LOCAL_WORLD_SIZE") or env.get("OMPI_COMM_WORLD_LOCAL_SIZE") or 1)
    return max(1, len(os.sched_getaffinity(0)) // max(1, local) - 1)


class Samples(Dataset):
    """Keys are (index, augmentation seed): the seed travels with the index, so the crop and flip do
    not depend on which worker decodes the image, nor on any worker's RNG."""

    def __init__(self, folder: ImageFolder, size: int, train: bool):
        self.folder, self.size, self.train = folder, size, train

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        images, labels = self.__getitems__([key])
        return images[0], int(labels[0])

    def __getitems__(self, keys: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch (DataLoader's fetcher calls this for a batch_sampler's keys): uint8 NHWC images, a
        quarter of float32's bytes to pin and copy, each decoded straight into its slot, and int64
        labels. In a worker the batch is allocated in shared memory, as default_collate does: a
        tensor in private memory is copied into shared memory again to cross the worker's queue."""
        images = _batch_buffer(len(keys), self.size)
        for slot, (index, seed) in zip(images.numpy(), keys):
            self.decode_into(slot, index, seed)
        return images, torch.tensor([self.folder.samples[index][1] for index, _ in keys])

    def decode_into(self, slot, index: int, seed: int) -> None:
        decode_into(slot, self.folder.samples[index][0], self.size, self.train, seed)


def _batch_buffer(count: int, size: int) -> torch.Tensor:
    if get_worker_info() is None:
        return torch.empty(count, size, size, 3, dtype=torch.uint8)
    empty = torch.empty(0, dtype=torch.uint8)
    storage = empty._typed_storage()._new_shared(count * size * size * 3, device=empty.device)
    return empty.new(storage).view(count, size, size, 3)


def collate(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples.__getitems__ made the batch (images, labels) already."""
    return batch


def train_keys(
    size: int, batch_per_rank: int, world: int, rank: int, seed: int, start: int
) -> Iterator[list[tuple[int, int]]]:
    """This rank's keys for positions start, start + 1, ... (position = step x grad_accum + micro):
    its slice of the global batch (DistributedSampler's semantics: disjoint shards, the same count on
    every rank), and the augmentation seeds the synchronous loader used (seed x 7919 + position). The
    indices are data.global_batch_indices', each epoch's permutation drawn once (SentenceBatches): drawn at
    every batch it cost the training process 17 ms a batch on ImageNet's 1.28M images."""
    batches = SentenceBatches(size, batch_per_rank * world, seed)
    for position in itertools.count(start):
        indices = batches.indices(position)
        batch_seed = seed * 7919 + position
        yield [(i, batch_seed * 1_000_003 + i) for i in rank_slice(indices, rank, world)]


def loader(samples: Samples, keys, workers: int, pin: bool, seed: int) -> DataLoader:
    """Its own generator: otherwise each new iterator draws its base seed from the global RNG
    (torch/utils/data/dataloader.py, _BaseDataLoaderIter), shifting the trainer's dropout masks."""
    return DataLoader(
        samples,
        batch_sampler=keys,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=pin,
        persistent_workers=workers > 0,
        prefetch_factor=PREFETCH if workers > 0 else None,
        generator=torch.Generator().manual_seed(seed),
    )


def to_device(batch: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype = torch.float32):
    """Copy (non-blocking from pinned memory), then normalise on the device: NHWC uint8 permuted to
    NCHW is channels-last in memory, and every op below keeps that layout."""
    images, labels = batch
    images = images.to(device, non_blocking=True).permute(0, 3, 1, 2)
    mean, std = _mean_std(device)
    images = images.float().sub_(mean).div_(std).to(dtype)
    return images, labels.to(device, non_blocking=True)


_ON_DEVICE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _mean_std(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Copied to the device once: a pageable host tensor's `.to(device)` waits for the GPU's stream,
    and at every micro-batch that drained the queue before each step's work."""
    if device not in _ON_DEVICE:
        _ON_DEVICE[device] = ((MEAN * 255).to(device), (STD * 255).to(device))
    return _ON_DEVICE[device]


class TrainStream:
    """The train batches of a run, position by position, from one long-lived iterator (its workers
    live for the run); asked for a position other than the next one (a resume, a benchmark), it
    starts a new iterator there."""

    def __init__(self, folder: ImageFolder, size: int, batch_per_rank: int, world: int, rank: int, seed: int):
        self.samples = Samples(folder, size, train=True)
        self.shape = (batch_per_rank, world, rank, seed)
        self.workers, self.pin = 0, False
        self._iterator: Iterator | None = None
        self._next = -1

    def configure(self, workers: int, pin: bool) -> None:
        self.workers, self.pin = workers, pin

    def get(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._iterator is None or position != self._next:
            batch_per_rank, world, rank, seed = self.shape
            keys = train_keys(len(self.samples), batch_per_rank, world, rank, seed, position)
            self._iterator = iter(loader(self.samples, keys, self.workers, self.pin, seed))
        self._next = position + 1
        return next(self._iterator)
