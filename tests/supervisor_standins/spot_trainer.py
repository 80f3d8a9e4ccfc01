"""A stand-in rank for the supervisor tests (tests/test_restarts.py): its argv and exits are scripted."""

import json
import pathlib
import sys
import time

run = pathlib.Path(sys.argv[1])
args = sys.argv[2:]
(run / "config.json").write_text(json.dumps({"batch_per_gpu": 8, "grad_accum": 1, "max_steps": 20}))
(run / "checkpoints").mkdir(exist_ok=True)
(run / "checkpoints" / "step_00000012.pt").write_bytes(b"x")
print("args:", " ".join(args), flush=True)
if "--keep-global-batch" not in args:  # h2's watcher got a notice; the trainer checkpointed and ended
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (run / "interruptions.json").write_text(json.dumps([{"host": "h2", "action": "stop", "noticed": stamp}]))
    (run / "progress.json").write_text(json.dumps({"step": 12}))
    print("run ended at step 12: stop requested (checkpoint now, no eval)")
    sys.exit(0)
(run / "progress.json").write_text(json.dumps({"step": 20}))
print("run ended at step 20: max_steps")
