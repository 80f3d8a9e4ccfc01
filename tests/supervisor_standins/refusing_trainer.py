"""A stand-in rank for the supervisor tests (tests/test_restarts.py) with a run to resume (config.json, a
checkpoint): its first launch exits 2 as train.py does when it refuses, after a step (a heartbeat in ranks/) with
--after-a-step; any later launch finishes."""

import json
import pathlib
import sys

REFUSAL = "error: the checkpoint was trained at a global batch of 24; this launch makes 16"

run = pathlib.Path(sys.argv[1])
(run / "config.json").write_text(json.dumps({"batch_per_gpu": 8, "grad_accum": 1}))
(run / "checkpoints").mkdir(exist_ok=True)
(run / "checkpoints" / "step_00000010.pt").write_bytes(b"x")
launches = run / "launches"
launches.write_text(launches.read_text() + "x" if launches.exists() else "x")
if len(launches.read_text()) > 1:
    print("run ended at step 20: max_steps")
    sys.exit(0)
if sys.argv[2:] == ["--after-a-step"]:
    (run / "ranks" / "rank0").write_text("11 1 n0\n")
print(REFUSAL, file=sys.stderr)
sys.exit(2)
