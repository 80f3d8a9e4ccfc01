"""Translate lines from stdin with a checkpoint:

echo "four thousand two hundred and seventy-one" | python -m train.translate RUN_DIR/checkpoints/best.pt
"""

import argparse
import sys
from pathlib import Path

import torch

from train import checkpoint
from train.config import TrainConfig
from train.data import EOS, Tokenizer
from train.evaluate import translate
from train.model import Transformer


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Translate stdin lines with a checkpoint.")
    parser.add_argument("checkpoint")
    parser.add_argument("--vocabulary", help="spm.model (default: the path saved in the checkpoint)")
    parser.add_argument("--beam", type=int, default=1)
    args = parser.parse_args(argv)
    if not Path(args.checkpoint).is_file():
        hint = "`fab fetch RUN` brings the run's checkpoint home (a run checkpoints every --checkpoint-every steps)"
        print(f"error: no checkpoint at {args.checkpoint}: {hint}", file=sys.stderr)
        return 2
    state = checkpoint.load_file(args.checkpoint)
    config = TrainConfig.from_dict(state["config"])
    vocabulary = args.vocabulary or state["vocabulary"]
    if not Path(vocabulary).exists():
        local = Path(args.checkpoint).resolve().parent.parent / "spm.model"
        if not local.exists():
            print(f"error: vocabulary {vocabulary} not found; pass --vocabulary PATH/spm.model", file=sys.stderr)
            return 2
        vocabulary = str(local)
    tokenizer = Tokenizer(vocabulary)
    model = Transformer(config.model, tokenizer.vocab_size)
    model.load_state_dict(state["model"])
    model.eval()
    lines = [line.rstrip("\n") for line in sys.stdin]
    tokens = [ids[: config.model.max_len - 1] + [EOS] for ids in tokenizer.encode(lines)]
    with torch.no_grad():
        out = translate(model, tokens, 64, args.beam, torch.device("cpu"))
    for line in tokenizer.decode(out):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
