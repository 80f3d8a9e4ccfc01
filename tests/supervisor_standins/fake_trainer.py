"""A stand-in rank for the supervisor tests (tests/test_restarts.py): its argv and exits are scripted."""

import json
import os
import pathlib
import sys
import time

run = pathlib.Path(sys.argv[1])
args = ["-np", os.environ["MPIRUN_NP"], "MASTER_ADDR=" + os.environ["MASTER_ADDR"], *sys.argv[2:]]
(run / "config.json").write_text(json.dumps({"batch_per_gpu": 8, "grad_accum": 1}))
(run / "checkpoints").mkdir(exist_ok=True)
(run / "checkpoints" / "step_00000010.pt").write_bytes(b"x")
print("args:", " ".join(args), flush=True)
if "--keep-global-batch" not in args:
    (run / "ranks").mkdir(exist_ok=True)
    (run / "ranks" / "rank0").write_text("10 1 n0\n")
    time.sleep(float(sys.argv[-1]) if args[-2:-1] == ["--sleep"] else 0)
    sys.exit(1)
print("run ended at step 20: max_steps")
