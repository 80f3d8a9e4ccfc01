"""A torchrun worker for test_training: rank 1 sees a stale checkpoint listing (the newest file not
there yet, as NFS attribute caching can show it), then every rank builds the Trainer and prints the
step and the file it resumed from, as JSON."""

import json
import sys

from train import checkpoint, distributed
from train.config import build_parser, config_from_args
from train.train import compose

info, device = distributed.setup(timeout_s=60)
if info.rank == 1:
    listing = checkpoint.list_steps
    checkpoint.list_steps = lambda run_dir: listing(run_dir)[:-1]
config = config_from_args(build_parser("").parse_args(sys.argv[1:]))
trainer = compose(config, info, device)
print(json.dumps({"rank": info.rank, "step": trainer.step, "path": trainer.resumed_from}), flush=True)
distributed.teardown()
