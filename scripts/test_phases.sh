#!/usr/bin/env bash
# make test: two phases, then one line with each part's wall time (issue 31: the suite's budget is 12 minutes
# on a 2-core machine; this line is where to read it). A phase that fails ends the run with its exit status,
# after the line.
#
# 1. Everything but the emulated cluster on two xdist workers, and beside it, each in a process of its own with
#    its output shown when it ends: the emulated-cluster tests whose assertions no other load moves (`not
#    timed`: one cluster at a time still), and the training program's tests on the training image's Python,
#    torch and numpy (one worker). Those run once, on the torch that trains (--except-image-torch leaves them
#    out of the first part; the checkout's torch runs the trainer end to end on the emulated cluster). The
#    two cores are busy throughout with two workers and one: more processes only take turns and lose their
#    caches (three workers and two took 1,050 CPU-seconds for this phase, two and one 909: docs/tests.md).
# 2. The `timed` cluster tests alone: their windows, predictions and link shares hold on a machine to
#    themselves (other work slowed them by 16-40%, docs/tests.md).
set -uo pipefail
cd "$(dirname "$0")/.." || exit
# Some machines set it: each of the suite's Python processes (~300 fab calls, ~150 trainer ranks, the pytest
# workers, each rewriting every test module) would compile the checkout's modules again (.gitignore and the
# image asset leave __pycache__ out).
unset PYTHONDONTWRITEBYTECODE
timings=()
status=0
logs=$(mktemp -d)
# The cluster tests' prepared data sets, made once for both phases (tests/cluster_harness.py).
export GPU_CLUSTER_TEST_DATA_CACHE=$logs/cluster-data
# The emulated cluster and the bootstrap sandbox (tests/bootstrap_sandbox.py) both bind onto the host's /data,
# each in mount namespaces of its own, and each removes /data after it if it made it: removing it detaches the
# other's binds, mid-test, and the first phase runs them at once. On a machine without /data (a fresh one),
# this run makes it first and removes it last, so neither part makes or removes it.
made_data=false
if [[ ! -e /data && $EUID == 0 ]]; then
  mkdir /data && made_data=true
fi
trap 'report; rm -rf "$logs"; if $made_data; then rmdir /data 2>/dev/null; fi' EXIT

minutes() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

record() {  # NAME SECONDS STATUS
  timings+=("$1 $(minutes "$2")$([[ $3 == 0 ]] || echo " (failed)")")
  [[ $3 == 0 ]] || status=$3
}

phase() {  # NAME COMMAND...: in the foreground
  local name=$1 start=$SECONDS
  shift
  "$@"
  local code=$?
  record "$name" $((SECONDS - start)) "$code"
  return "$code"
}

beside() {  # NAME COMMAND...: in the background, its output and its "status seconds" under $logs/NAME
  local name=$1
  shift
  (
    start=$SECONDS
    "$@" >"$logs/$name.log" 2>&1
    echo "$? $((SECONDS - start))" >"$logs/$name.done"
  ) &
}

collect() {  # NAME: wait for a `beside` part, show its output, record it
  local name=$1 code seconds
  while [[ ! -f $logs/$name.done ]]; do wait -n 2>/dev/null || sleep 1; done
  read -r code seconds <"$logs/$name.done"
  echo "---------------------------------------------------------------- $name (run beside the tests)"
  cat "$logs/$name.log"
  record "$name" "$seconds" "$code"
}

report() {
  local line
  line=$(printf '%s, ' "${timings[@]}")
  echo "make test: ${line%, } (total $(minutes "$SECONDS"))"
}

# The modules with emulated-cluster tests: collecting the other hundred too (torch, the CDK, moto) costs each
# cluster session ~3 s of CPU, the timed one on its clock.
mapfile -t cluster_modules < <(grep -l 'mark\.cluster' tests/test_*.py)
beside "cluster (untimed)" python -m pytest -p no:cacheprovider -m "cluster and not timed" "${cluster_modules[@]}"
beside "image-torch" bash scripts/test_image_torch.sh -n 1  # its last -n wins
# A crashed worker ends the phase, failed (--max-worker-restart 0): loadgroup waits for good on a replacement.
phase "tests" python -m pytest -n 2 --dist loadgroup --max-worker-restart 0 -m "not cluster" --except-image-torch
collect "cluster (untimed)"
collect "image-torch"
[[ $status == 0 ]] || exit "$status"
phase "cluster (timed)" python -m pytest -m "cluster and timed" "${cluster_modules[@]}" || exit
