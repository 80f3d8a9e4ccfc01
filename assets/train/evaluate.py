"""Evaluation across ranks: per-token loss on the valid split, decoding, sacrebleu BLEU on rank 0."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from train import distributed
from train.config import TrainConfig
from train.data import PAD, DataSet


def bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU as WMT reports it: sacrebleu, detokenized text, 13a tokenisation, cased, one
    reference (checked against a published WMT17 figure in tests/test_real_text.py)."""
    import sacrebleu

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    return sacrebleu.corpus_bleu(hypotheses, [references], tokenize="13a").score


def translate(model, tokens: list[list[int]], batch: int, beam: int, device) -> list[list[int]]:
    from train.data import _pad

    out = []
    for start in range(0, len(tokens), batch):
        src = _pad(tokens[start : start + batch]).to(device)
        max_new = src.size(1) * 2 + 10
        out += model.greedy(src, max_new) if beam == 1 else model.beam_search(src, max_new, beam)
    return out


@torch.no_grad()
def evaluate(model, data: DataSet, config: TrainConfig, info, device) -> dict:
    pairs, sources, references = data.split("valid")
    count = min(config.eval_samples, len(pairs))
    mine = list(range(info.rank, count, info.world_size))
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, target tokens
    for start in range(0, len(mine), config.eval_batch):
        src, tgt_in, tgt_out = (t.to(device) for t in pairs.batch(mine[start : start + config.eval_batch]))
        logits = model(src, tgt_in)
        totals[0] += F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(), ignore_index=PAD, reduction="sum")
        totals[1] += tgt_out.ne(PAD).sum()
    distributed.all_reduce_sum(totals)
    hyp_ids = translate(model, [pairs.source(i) for i in mine], config.eval_batch, config.beam, device)
    hypotheses = dict(zip(mine, data.tokenizer.decode(hyp_ids)))
    merged: dict[int, str] = {}
    for part in distributed.all_gather_objects(hypotheses):
        merged.update(part)
    ordered = [merged[i] for i in range(count)]
    refs = references[:count]
    score = bleu(ordered, refs)
    exact = sum(h == r for h, r in zip(ordered, refs)) / max(count, 1)
    return {
        "eval_loss": (totals[0] / totals[1]).item(),
        "bleu": score,
        "exact_match": exact,
        "hypotheses": ordered,
        "references": refs,
        "sources": sources[:count],
    }
