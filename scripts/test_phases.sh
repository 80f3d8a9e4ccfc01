#!/usr/bin/env bash
# make test: the three phases in turn, then one line with each phase's wall time (issue 31: the suite's
# budget is 12 minutes on a 2-core machine; this line is where to read it). A phase that fails ends the
# run with its exit status, after the line.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
timings=()
status=0

phase() {  # NAME COMMAND...
  local name=$1 start=$SECONDS
  shift
  "$@"
  status=$?
  timings+=("$name $(minutes $((SECONDS - start)))$([[ $status == 0 ]] || echo " (failed)")")
  return "$status"
}

minutes() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

report() {
  local line
  line=$(printf '%s, ' "${timings[@]}")
  echo "make test: ${line%, } (total $(minutes "$SECONDS"))"
}
trap report EXIT

# Everything but the emulated cluster on three workers (some tests wait on real clocks: the watchdog's
# backoff, polls; a third worker fills those waits), then the emulated cluster alone (it needs the CPU),
# then the training program's tests on the training image's Python, torch and numpy. Those run once, on
# the torch that trains (--except-image-torch leaves them out of the first phase; the checkout's torch
# runs the trainer end to end in the cluster phase).
phase "tests" python -m pytest -n 3 --dist loadgroup -m "not cluster" --except-image-torch || exit
phase "cluster" python -m pytest -m cluster || exit
phase "image-torch" bash scripts/test_image_torch.sh || exit
