"""Transformer encoder-decoder (Vaswani et al. 2017) with a shared source/target vocabulary."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from train.config import ModelConfig

PAD, UNK, BOS, EOS = 0, 1, 2, 3
warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")


def sinusoids(length: int, dim: int) -> torch.Tensor:
    position = torch.arange(length).unsqueeze(1)
    scale = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(position * scale)
    table[:, 1::2] = torch.cos(position * scale)
    return table


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, vocab_size: int):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(vocab_size, config.d_model, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=config.d_model**-0.5)
        self.register_buffer("positions", sinusoids(config.max_len, config.d_model), persistent=False)
        self.core = nn.Transformer(
            d_model=config.d_model,
            nhead=config.heads,
            num_encoder_layers=config.layers,
            num_decoder_layers=config.layers,
            dim_feedforward=config.ffn,
            dropout=config.dropout,
            batch_first=True,
            norm_first=config.pre_norm,
        )
        self.dropout = nn.Dropout(config.dropout)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        positions: torch.Tensor = self.positions  # type: ignore[assignment]  # a registered buffer
        x = self.embed(tokens) * math.sqrt(self.config.d_model) + positions[: tokens.size(1)]
        return self.dropout(x)

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        src_pad = src.eq(PAD)
        return self.core.encoder(self._embed(src), src_key_padding_mask=src_pad), src_pad

    def decode(self, tgt_in: torch.Tensor, memory: torch.Tensor, src_pad: torch.Tensor) -> torch.Tensor:
        length = tgt_in.size(1)
        causal = torch.ones(length, length, dtype=torch.bool, device=tgt_in.device).triu(1)
        hidden = self.core.decoder(
            self._embed(tgt_in),
            memory,
            tgt_mask=causal,
            # No target padding mask: rows are padded on the right, so under the causal mask a real token
            # never sees a PAD, and a PAD's own output is not scored (the loss ignores PAD). Without it the
            # self-attention is SDPA's causal kernel (flash on a GPU); with it, nn.MultiheadAttention merges
            # both masks into a (batch x heads, T, T) float mask every layer and step.
            tgt_is_causal=True,
            memory_key_padding_mask=src_pad,
        )
        return F.linear(hidden, self.embed.weight)  # tied output projection

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        memory, src_pad = self.encode(src)
        return self.decode(tgt_in, memory, src_pad)

    @torch.no_grad()
    def greedy(self, src: torch.Tensor, max_new: int) -> list[list[int]]:
        memory, src_pad = self.encode(src)
        out = torch.full((src.size(0), 1), BOS, dtype=torch.long, device=src.device)
        done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
        for _ in range(min(max_new, self.config.max_len - 1)):
            next_token = self.decode(out, memory, src_pad)[:, -1].argmax(-1)
            next_token = next_token.masked_fill(done, PAD)
            out = torch.cat([out, next_token[:, None]], dim=1)
            done |= next_token.eq(EOS)
            if done.all():
                break
        return [_strip(row) for row in out[:, 1:].tolist()]

    @torch.no_grad()
    def beam_search(self, src: torch.Tensor, max_new: int, beam: int, alpha: float = 0.6) -> list[list[int]]:
        """Beam search per sentence with GNMT length normalisation."""
        results = []
        for i in range(src.size(0)):
            memory, src_pad = self.encode(src[i : i + 1])
            beams = [([BOS], 0.0)]
            finished: list[tuple[list[int], float]] = []
            for _ in range(min(max_new, self.config.max_len - 1)):
                tokens = torch.tensor([b[0] for b in beams], device=src.device)
                logp = self.decode(tokens, memory.expand(len(beams), -1, -1), src_pad.expand(len(beams), -1))[
                    :, -1
                ].log_softmax(-1)
                scores = torch.tensor([b[1] for b in beams], device=src.device)[:, None] + logp
                top = scores.flatten().topk(beam)
                beams = []
                for score, index in zip(top.values.tolist(), top.indices.tolist()):
                    row, token = divmod(index, logp.size(1))
                    sequence = tokens[row].tolist() + [token]
                    if token == EOS:
                        finished.append((sequence, score / (((5 + len(sequence)) / 6) ** alpha)))
                    else:
                        beams.append((sequence, score))
                if not beams or len(finished) >= beam:
                    break
            finished += [(s, sc / (((5 + len(s)) / 6) ** alpha)) for s, sc in beams]
            results.append(_strip(max(finished, key=lambda item: item[1])[0][1:]))
        return results


def _strip(tokens: list[int]) -> list[int]:
    out = []
    for token in tokens:
        if token in (EOS, PAD):
            break
        out.append(token)
    return out
