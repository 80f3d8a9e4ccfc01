#!/usr/bin/env bash
# Runs one training job on the head node, detached from the fab connection:
#   setsid launcher.sh RUN_DIR     (fab train uploads RUN_DIR/launch.env and RUN_DIR/command.sh)
# Logs to RUN_DIR/train.log. A watchdog ends the run when a node stops answering SSH or training
# makes no progress (mpirun alone hangs forever on a network partition), then writes
# RUN_DIR/run-status.json: state, exit code, reason.
set -uo pipefail

RUN_DIR=${1:?usage: launcher.sh RUN_DIR}
# shellcheck source=/dev/null
source "$RUN_DIR/launch.env"
: "${HOSTS:?}" "${SSH_CONFIG:?}" "${ACTIVE_FILE:?}"
POLL_SECONDS=${POLL_SECONDS:-5}
STALL_SECONDS=${STALL_SECONDS:-600}
START_SECONDS=${START_SECONDS:-900}  # the first step must come within this (mpirun start-up, data load)
PYTHON=${PYTHON:-python3}
UNREACHABLE_LIMIT=${UNREACHABLE_LIMIT:-2}
LOG=$RUN_DIR/train.log

now() { date -u +%FT%TZ; }
status() {  # status STATE EXIT_CODE REASON: written by a JSON library, whatever the reason holds
  "$PYTHON" -c '
import json, os, sys
path, state, code, reason, time, head = sys.argv[1:]
record = {"state": state, "exit_code": None if code == "null" else int(code), "reason": reason,
          "time": time, "head": head}
with open(path + ".tmp", "w") as handle:
    json.dump(record, handle)
os.replace(path + ".tmp", path)
' "$RUN_DIR/run-status.json" "$1" "$2" "$3" "$(now)" "$(hostname)"
}

echo $$ > "$RUN_DIR/launcher.pid"
status running null ""
echo "$(now) launcher: starting on $(hostname): $(cat "$RUN_DIR/command.sh")" >> "$LOG"
bash "$RUN_DIR/command.sh" >> "$LOG" 2>&1 < /dev/null &
mpirun_pid=$!
echo "$mpirun_pid" > "$RUN_DIR/mpirun.pid"

reason=""
started=$(date +%s)
declare -A failures=()
while kill -0 "$mpirun_pid" 2>/dev/null; do
  sleep "$POLL_SECONDS"
  kill -0 "$mpirun_pid" 2>/dev/null || break
  for host in $HOSTS; do
    if timeout 15 ssh -F "$SSH_CONFIG" -o ConnectTimeout=5 "$host" true >/dev/null 2>&1; then
      failures[$host]=0
    else
      failures[$host]=$((${failures[$host]:-0} + 1))
      if ((failures[$host] >= UNREACHABLE_LIMIT)); then
        reason="node $host unreachable for $((UNREACHABLE_LIMIT * POLL_SECONDS))+ s"
        break 2
      fi
    fi
  done
  if [[ -f $RUN_DIR/progress.json && $(stat -c %Y "$RUN_DIR/progress.json") -ge $started ]]; then
    age=$(($(date +%s) - $(stat -c %Y "$RUN_DIR/progress.json")))
    if ((age > STALL_SECONDS)); then
      reason="no training progress for $age s"
      break
    fi
  elif (($(date +%s) - started > START_SECONDS)); then
    reason="no training step within $START_SECONDS s of the start (mpirun or the data load is stuck: see train.log)"
    break
  fi
done

cleanup() {  # cleanup HOST: this run's ranks and the MPI daemons (one run at a time per cluster)
  timeout 15 ssh -F "$SSH_CONFIG" -o ConnectTimeout=5 "$1" \
    "pkill -KILL -f -- '[-]-run-dir $RUN_DIR'; pkill -KILL -x orted; pkill -KILL -x prted; true" >/dev/null 2>&1
}

unreached=""
if [[ -n $reason ]]; then
  echo "$(now) watchdog: $reason; ending the run" >> "$LOG"
  kill -TERM "$mpirun_pid" 2>/dev/null
  for _ in 1 2 3 4 5; do kill -0 "$mpirun_pid" 2>/dev/null || break; sleep 1; done
  kill -KILL "$mpirun_pid" 2>/dev/null
  for host in $HOSTS; do
    cleanup "$host" || unreached+=" $host"
  done
fi
wait "$mpirun_pid"
code=$?
if [[ -f $RUN_DIR/FORCED ]]; then
  status failed "$code" "stopped by fab stop --force"
elif [[ -n $reason ]]; then
  status failed "$code" "watchdog: $reason"
elif ((code == 0)); then
  status finished 0 "$(grep -o 'run ended at step.*' "$LOG" | tail -n 1)"
else
  status failed "$code" "$(grep -E 'mpirun noticed|exited on signal|Error|error:' "$LOG" | tail -n 1)"
fi
echo "$(now) launcher: mpirun exited with $code" >> "$LOG"
[[ $(cat "$ACTIVE_FILE" 2>/dev/null) == "$RUN_DIR" ]] && rm -f "$ACTIVE_FILE"

if [[ ${THEN_STOP:-0} == 1 ]]; then  # fab train --then-stop: stop the cluster's instances now
  export CLUSTER_NAME AWS_REGION AWS_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_DEFAULT_REGION
  "$PYTHON" "$AUTOSTOP" --stop-now >> "$LOG" 2>&1 || echo "$(now) launcher: --then-stop failed" >> "$LOG"
fi

# A partitioned node keeps its MPI daemon until someone reaches it: retry for a while, unless a
# new run has started (its daemons must not be touched).
deadline=$(($(date +%s) + ${CLEANUP_SECONDS:-600}))
while [[ -n ${unreached// /} ]] && (($(date +%s) < deadline)) && [[ ! -s $ACTIVE_FILE ]]; do
  sleep 10
  pending=""
  for host in $unreached; do
    if cleanup "$host"; then
      echo "$(now) launcher: cleaned up $host after it came back" >> "$LOG"
    else
      pending+=" $host"
    fi
  done
  unreached=$pending
done
exit "$code"
