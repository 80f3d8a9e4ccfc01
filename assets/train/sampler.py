"""Which training pairs go into which micro-batch: token-budget buckets (fairseq's `--max-tokens`)
or fixed sentence batches, each epoch's permutation drawn once, a fixed function of (seed, step).

Tokens (the default for translation): an epoch is one seeded permutation of all pairs, cut into
chunks of CHUNK_BATCHES budgets' worth of pairs; each chunk is sorted by length and packed greedily
into buckets of at most `budget` tokens, counted as fairseq's batch_by_size does (sentences x the
longest one's cost, a pair's cost being max(source, target) length); the epoch's buckets are then
shuffled. With --pad-multiple m > 1 (new runs: 8) ShapeBuckets groups pairs by their lengths rounded
up to m instead, for a bounded set of batch shapes. Epochs follow each other in one endless sequence
of buckets, and micro-batch m of rank r at step s is bucket (s * world + r) * accum + m: every rank
gets `accum` buckets at every step (no rank waits in a collective for another's extra batch), and
any world size and accumulation with the same product sees the same buckets at the same step.
"""

from __future__ import annotations

import bisect
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, TypeVar

import numpy as np
import torch

# Sorting within chunks of some batches' worth (torchtext's BucketIterator pool, OpenSeq2Seq; fairseq
# sorts the whole set) trades padding against how alike in length, so in content, a batch's pairs
# are. Ding pads 6.5% at 100 batches, 9.4% at 40 (README, *Text input pipeline*).
CHUNK_BATCHES = 100


def epoch_seed(seed: int, epoch: int) -> int:
    return seed * 1_000_003 + epoch  # the formula data.global_batch_indices has always used


def side_costs(src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """A pair's tokens on each side as the model sees them (source + EOS, BOS + target, both truncated
    as PairDataset truncates)."""
    return np.minimum(src_lengths, max_len - 1) + 1, np.minimum(tgt_lengths, max_len - 2) + 1


def pair_costs(src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_len: int) -> np.ndarray:
    """The larger side's tokens: fairseq LanguagePairDataset.num_tokens."""
    src, tgt = side_costs(src_lengths, tgt_lengths, max_len)
    return np.maximum(src, tgt).astype(np.int64)


def token_budget(batch_per_gpu: int, costs: np.ndarray, max_tokens: int = 0) -> int:
    """--max-tokens when given, else --batch-per-gpu x the mean pair cost: the same tokens per
    micro-batch, on average, as the recipe's sentence batch. Never below the longest pair."""
    budget = max_tokens or int(np.ceil(batch_per_gpu * float(costs.mean())))
    return max(budget, int(costs.max()))


def pack(order: np.ndarray, costs: np.ndarray, budget: int) -> list[np.ndarray]:
    """`order` (ascending cost) cut greedily into runs whose count x last cost <= budget."""
    sorted_costs = costs[order]
    out, start, n = [], 0, len(order)
    while start < n:
        cap = max(1, budget // int(sorted_costs[start]))
        window = sorted_costs[start : start + cap]
        # count x cost grows with the count (costs ascend): the fitting runs form a prefix.
        fits = int(np.count_nonzero(np.arange(1, len(window) + 1) * window <= budget))
        take = max(1, fits)
        out.append(order[start : start + take])
        start += take
    return out


class _EndlessBuckets:
    """Epochs of buckets, each epoch a pure function of (seed, epoch), in one endless sequence."""

    def __init__(self, seed: int):
        self.seed = seed
        self._starts = [0]  # epoch e's buckets are positions [_starts[e], _starts[e + 1])
        self._cache: dict[int, list[np.ndarray]] = {}

    def _pack(self, epoch: int) -> list[np.ndarray]:
        raise NotImplementedError

    def epoch(self, epoch: int) -> list[np.ndarray]:
        """Epoch `epoch`'s buckets in training order (the last two epochs are kept)."""
        if epoch not in self._cache:
            self._cache[epoch] = self._pack(epoch)
            for old in [e for e in self._cache if e < epoch - 1]:
                del self._cache[old]
        return self._cache[epoch]

    def bucket(self, position: int) -> np.ndarray:
        """The pairs of bucket `position` of the endless sequence (a resume replays the earlier
        epochs' bucket counts: a pure function of the seed, so the same buckets follow)."""
        while self._starts[-1] <= position:
            self._starts.append(self._starts[-1] + len(self.epoch(len(self._starts) - 1)))
        epoch = bisect.bisect_right(self._starts, position) - 1
        return self.epoch(epoch)[position - self._starts[epoch]]

    def epoch_of(self, position: int) -> tuple[int, int]:
        """(epoch, bucket within it) of a position."""
        self.bucket(position)
        epoch = bisect.bisect_right(self._starts, position) - 1
        return epoch, position - self._starts[epoch]


class TokenBuckets(_EndlessBuckets):
    """--pad-multiple 1 (and runs saved before it): sorted within chunks, padded to the longest."""

    def __init__(self, costs: np.ndarray, sort_key: np.ndarray, budget: int, seed: int):
        super().__init__(seed)
        self.costs, self.key, self.budget = costs, sort_key, budget
        self.chunk = max(1, round(CHUNK_BATCHES * budget / float(costs.mean())))

    def _pack(self, epoch: int) -> list[np.ndarray]:
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        perm = torch.randperm(len(self.costs), generator=generator).numpy()
        buckets: list[np.ndarray] = []
        for start in range(0, len(perm), self.chunk):
            chunk = perm[start : start + self.chunk]
            buckets += pack(chunk[np.argsort(self.key[chunk], kind="stable")], self.costs, self.budget)
        shuffle = torch.randperm(len(buckets), generator=generator).tolist()
        return [buckets[i] for i in shuffle]


def round_up(values: np.ndarray, multiple: int, cap: int) -> np.ndarray:
    """Each value rounded up to a multiple of `multiple`, at most `cap` (the model's max_len)."""
    return np.minimum(-(-values // multiple) * multiple, cap)


class ShapeBuckets(_EndlessBuckets):
    """--pad-multiple m > 1: a pair's class is its (source, target) widths rounded up to m; a class's
    pairs, in the epoch's permutation order (random content within a class), are cut into batches of
    budget // max(widths) pairs, padded to the class's widths. So an epoch holds at most two batch
    shapes per class (its full batches and its last one), every length a multiple of m: a GPU meets
    a bounded set of shapes (cuDNN's per-shape plans, aligned attention masks) whatever the data."""

    def __init__(self, src_width: np.ndarray, tgt_width: np.ndarray, budget: int, seed: int):
        super().__init__(seed)
        self.widths = np.stack([src_width, tgt_width], axis=1).astype(np.int64)
        self.costs = self.widths.max(axis=1)
        self.budget = budget
        self.classes, self.group = np.unique(self.widths, axis=0, return_inverse=True)
        self.group = self.group.reshape(-1)

    def _pack(self, epoch: int) -> list[np.ndarray]:
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        perm = torch.randperm(len(self.costs), generator=generator).numpy()
        by_class = perm[np.argsort(self.group[perm], kind="stable")]  # permutation order within a class
        bounds = np.flatnonzero(np.diff(self.group[by_class])) + 1
        buckets: list[np.ndarray] = []
        for members in np.split(by_class, bounds):
            size = max(1, self.budget // int(self.costs[members[0]]))
            buckets += [members[i : i + size] for i in range(0, len(members), size)]
        shuffle = torch.randperm(len(buckets), generator=generator).tolist()
        return [buckets[i] for i in shuffle]

    def widths_of(self, bucket: np.ndarray) -> tuple[int, int]:
        source, target = self.widths[bucket[0]]
        return int(source), int(target)

    def commonest(self, position: int, limit: int) -> list[np.ndarray]:
        """A bucket of each of the `limit` commonest batch shapes (rows, source and target widths) of the
        epoch holding `position`, most tokens first (the largest memory blocks are taken first)."""
        epoch, _ = self.epoch_of(position)
        first: dict[tuple[int, int, int], np.ndarray] = {}
        counts: Counter = Counter()
        for bucket in self.epoch(epoch):
            shape = (len(bucket), *self.widths_of(bucket))
            first.setdefault(shape, bucket)
            counts[shape] += 1
        chosen = [shape for shape, _ in counts.most_common(limit)]
        chosen.sort(key=lambda shape: shape[0] * (shape[1] + shape[2]), reverse=True)
        return [first[shape] for shape in chosen]


class SentenceBatches:
    """--batching sentences: global batch g holds pairs [g*B, (g+1)*B) of the endless sequence of
    epoch permutations (the same pairs data.global_batch_indices gives, with each epoch's
    permutation drawn once instead of at every step)."""

    def __init__(self, size: int, global_batch: int, seed: int):
        self.size, self.global_batch, self.seed = size, global_batch, seed
        self._perm: tuple[int, torch.Tensor] = (-1, torch.empty(0, dtype=torch.long))

    def _permutation(self, epoch: int) -> torch.Tensor:
        """Kept as a tensor (8 bytes an index; ImageNet's 1.28M as a list: ~46 MB a rank)."""
        if self._perm[0] != epoch:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            self._perm = (epoch, torch.randperm(self.size, generator=generator))
        return self._perm[1]

    def indices(self, index: int) -> list[int]:
        out: list[int] = []
        position = index * self.global_batch
        while len(out) < self.global_batch:
            epoch, offset = divmod(position, self.size)
            take = min(self.global_batch - len(out), self.size - offset)
            out.extend(self._permutation(epoch)[offset : offset + take].tolist())
            position += take
        return out


T = TypeVar("T")


class Prefetcher(Generic[T]):
    """build(step) on one worker thread, one step ahead: the next step's batches are made while
    this one computes. A step other than the one prefetched (a resume) is built on demand. The
    batches are a fixed function of the step, so prefetching changes no sample."""

    def __init__(self, build: Callable[[int], T]):
        self.build = build
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batches")
        self.made: dict[int, Future] = {}  # the step last asked for and the one after it

    def get(self, step: int) -> T:
        current = self.made.get(step) or self.pool.submit(self.build, step)
        following = self.made.get(step + 1) or self.pool.submit(self.build, step + 1)
        self.made = {step: current, step + 1: following}  # asked twice (a start-of-run probe): built once
        return current.result()
