"""Workers for test_checkpoint_async. `slow-writer TRAIN_ARGS...`: train.train with every checkpoint write
taking 3 s longer (the process ends as the trainer does, os._exit: a write still running is lost).
`resume SNAPSHOT_DIR_RANK0 SNAPSHOT_DIR_RANK1 TRAIN_ARGS...` (under torchrun): each rank's node snapshot
directory, then every rank builds the Trainer and prints the step and the file it resumed from, as JSON."""

import json
import os
import sys
import time

from cluster_node.protocol import rundir
from train import checkpoint, distributed

mode, args = sys.argv[1], sys.argv[2:]
if mode == "slow-writer":
    from train.train import main

    save = checkpoint.save

    def slow_save(*a, **k):
        time.sleep(3)
        return save(*a, **k)

    checkpoint.save = slow_save
    distributed.exit_without_finalizing(main(args))
else:
    from train.config import build_parser, config_from_args
    from train.train import compose

    rank = int(os.environ["RANK"])
    os.environ[rundir.SNAPSHOT_DIR_ENV] = args[rank]
    info, device = distributed.setup(timeout_s=60)
    config = config_from_args(build_parser("").parse_args(args[2:]))
    trainer = compose(config, info, device)
    print(json.dumps({"rank": info.rank, "step": trainer.step, "path": trainer.resumed_from}), flush=True)
    distributed.teardown()
