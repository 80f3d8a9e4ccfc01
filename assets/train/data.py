"""Data: sentencepiece tokenizer, compact binary shards of token ids, deterministic global batches.

A data set directory holds `spm.model`, `train-NNNNN.pt` shards, `valid.pt`, `test.pt`, the raw
`{split}.en`/`{split}.de` text of valid and test (references), and `meta.json`.
"""

from __future__ import annotations

import bisect
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from train.model import BOS, EOS, PAD

SHARD_PAIRS = 500_000


class Tokenizer:
    def __init__(self, model_path: str | os.PathLike):
        import sentencepiece as spm

        self.path = str(model_path)
        self.sp = spm.SentencePieceProcessor(model_file=self.path)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, lines: Sequence[str]) -> list[list[int]]:
        return self.sp.encode(list(lines))

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return self.sp.decode([list(x) for x in ids])

    @staticmethod
    def train(text_files: Iterable[str], prefix: str, vocab_size: int) -> None:
        import sentencepiece as spm

        spm.SentencePieceTrainer.train(
            input=",".join(text_files),
            model_prefix=prefix,
            vocab_size=vocab_size,
            model_type="bpe",
            character_coverage=1.0,
            hard_vocab_limit=False,
            pad_id=PAD,
            unk_id=1,
            bos_id=BOS,
            eos_id=EOS,
            input_sentence_size=2_000_000,
            shuffle_input_sentence=True,
            minloglevel=2,
        )


def atomic_write_bytes(path: Path, write) -> None:
    """write(file) into a temp file next to path, fsync, rename: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: no half file left taking its space (RAM, for a snapshot)
        tmp.unlink(missing_ok=True)
        raise


def _flatten(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    offsets = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    flat = torch.tensor([t for s in sequences for t in s], dtype=torch.int32)
    return flat.to(torch.int16) if flat.numel() == 0 or flat.max() < 2**15 else flat, offsets


def write_pairs(path: Path, src_ids: list[list[int]], tgt_ids: list[list[int]]) -> None:
    src, src_off = _flatten(src_ids)
    tgt, tgt_off = _flatten(tgt_ids)
    atomic_write_bytes(path, lambda f: torch.save({"src": src, "src_off": src_off, "tgt": tgt, "tgt_off": tgt_off}, f))


class PairDataset:
    """Token-id pairs held as flat arrays plus offsets (a few bytes per token)."""

    def __init__(self, paths: Sequence[Path], max_len: int):
        if not paths:
            raise FileNotFoundError("no shards")
        parts = [torch.load(p, weights_only=True) for p in paths]
        self.max_len = max_len
        # numpy views of the loaded tensors: slicing one costs ~0.2 us, a tensor's ~2 us.
        self.src = [(part["src"].numpy(), part["src_off"].numpy()) for part in parts]
        self.tgt = [(part["tgt"].numpy(), part["tgt_off"].numpy()) for part in parts]
        self.sizes = [len(part["src_off"]) - 1 for part in parts]
        self.starts = torch.tensor([0] + self.sizes).cumsum(0).tolist()

    def __len__(self) -> int:
        return self.starts[-1]

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(source, target) token counts of every pair, before truncation."""
        src, tgt = (np.concatenate([np.diff(off) for _, off in store]) for store in (self.src, self.tgt))
        return src, tgt

    def _ids(self, store, index: int, limit: int) -> np.ndarray:
        shard = bisect.bisect_right(self.starts, index) - 1
        flat, offsets = store[shard]
        local = index - self.starts[shard]
        start = int(offsets[local])
        return flat[start : min(int(offsets[local + 1]), start + limit)]

    def _get(self, store, index: int) -> list[int]:
        """A side's stored ids, untruncated."""
        return self._ids(store, index, 2**62).tolist()

    def source(self, index: int) -> list[int]:
        return self._ids(self.src, index, self.max_len - 1).tolist() + [EOS]

    def target(self, index: int) -> list[int]:
        return self._ids(self.tgt, index, self.max_len - 2).tolist()

    def batch(
        self, indices: Sequence[int] | np.ndarray, widths: tuple[int, int] = (0, 0)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(src, tgt_in, tgt_out), padded with PAD: tgt_in starts with BOS, tgt_out ends with EOS; to
        the longest row, or to `widths` (source, target) where wider (sampler.ShapeBuckets)."""
        src = [self._ids(self.src, i, self.max_len - 1) for i in indices]
        tgt = [self._ids(self.tgt, i, self.max_len - 2) for i in indices]
        src_w, tgt_w = widths
        return (
            _padded(src, after=EOS, width=src_w),
            _padded(tgt, BOS, width=tgt_w),
            _padded(tgt, after=EOS, width=tgt_w),
        )


def _padded(
    rows: list[np.ndarray], before: int | None = None, after: int | None = None, width: int = 0
) -> torch.Tensor:
    """The rows, each with `before` in front or `after` behind it, padded with PAD to the longest
    (or to `width`, where wider)."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    out = np.full((len(rows), max(width, int(lengths.max(initial=0)) + 1)), PAD, dtype=np.int64)
    shift = 1 if before is not None else 0
    mask = np.arange(out.shape[1] - shift) < lengths[:, None]
    out[:, shift:][mask] = np.concatenate(rows) if rows else []
    if before is not None:
        out[:, 0] = before
    if after is not None:
        out[np.arange(len(rows)), lengths] = after
    return torch.from_numpy(out)


def padded_fraction(batch: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(PAD tokens, all tokens) of a (src, tgt_in, tgt_out) batch's source and target tensors."""
    src, _, tgt_out = batch
    total = src.numel() + tgt_out.numel()
    return total - int(src.ne(PAD).sum() + tgt_out.ne(PAD).sum()), total


def _pad(rows: list[list[int]]) -> torch.Tensor:
    out = torch.full((len(rows), max(len(r) for r in rows)), PAD, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def global_batch_indices(step: int, global_batch: int, size: int, seed: int) -> list[int]:
    """The examples of global batch `step` (0-based): a fixed function of (seed, step), so a
    resumed run and any world size that shares the global batch see the same data."""
    out: list[int] = []
    position = step * global_batch
    while len(out) < global_batch:
        epoch, offset = divmod(position, size)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(size, generator=generator)
        take = min(global_batch - len(out), size - offset)
        out.extend(perm[offset : offset + take].tolist())
        position += take
    return out


def rank_slice(indices: list[int], rank: int, world_size: int) -> list[int]:
    per_rank = len(indices) // world_size
    return indices[rank * per_rank : (rank + 1) * per_rank]


class DataSet:
    """A prepared data set directory (see module docstring)."""

    def __init__(self, root: str | os.PathLike, max_len: int):
        self.root = Path(root)
        meta_path = self.root / "meta.json"
        if not meta_path.exists():
            raise FileNotFoundError(
                f"no prepared data set in {self.root} (meta.json missing); run "
                f"`python -m train.prepare numbers --out {self.root}` or `fab data`"
            )
        self.meta = json.loads(meta_path.read_text())
        self.tokenizer = Tokenizer(self.root / "spm.model")
        self.train = PairDataset(sorted(self.root.glob("train-*.pt")), max_len)
        self.max_len = max_len

    def split(self, name: str) -> tuple[PairDataset, list[str], list[str]]:
        pairs = PairDataset([self.root / f"{name}.pt"], self.max_len)
        sources = (self.root / f"{name}.{self.meta['src_lang']}").read_text().splitlines()
        references = (self.root / f"{name}.{self.meta['tgt_lang']}").read_text().splitlines()
        return pairs, sources, references
