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
HANG_FACTOR=${HANG_FACTOR:-20}  # a hang: no rank finished a step in HANG_FACTOR x the step time,
HANG_FLOOR=${HANG_FLOOR:-60}    # and at least HANG_FLOOR s (checkpoints and evals take longer than a step)
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

hosts_in_use() {  # the attempt's nodes: the hostfile's (a restart rewrites it), else HOSTS
  if [[ -f $RUN_DIR/hostfile ]]; then awk '{print $1}' "$RUN_DIR/hostfile"; else echo "$HOSTS"; fi
}
newest_beat() {  # mtime of the newest per-rank heartbeat (RUN_DIR/ranks/rankN), 0 if none
  local newest=0 t
  for f in "$RUN_DIR"/ranks/rank*; do
    [[ -f $f ]] || continue
    t=$(stat -c %Y "$f"); ((t > newest)) && newest=$t
  done
  echo "$newest"
}
hang_window() {  # max(HANG_FACTOR x the measured step time, HANG_FLOOR), at most STALL_SECONDS
  local avg
  avg=$(grep -o '"avg_step_time_s": [0-9.eE+-]*' "$RUN_DIR/progress.json" 2>/dev/null | awk '{print $2}')
  awk -v a="${avg:-0}" -v k="$HANG_FACTOR" -v f="$HANG_FLOOR" -v s="$STALL_SECONDS" \
    'BEGIN { w = a * k; if (w < f) w = f; if (w > s) w = s; print int(w + 0.999) }'
}
collect_stacks() {  # Python stacks of every rank (py-spy where installed, else faulthandler via SIGUSR2)
  local host pids=()
  for host in $(hosts_in_use); do
    timeout 15 ssh -F "$SSH_CONFIG" -o ConnectTimeout=5 "$host" bash -s -- "$RUN_DIR" > "$RUN_DIR/stacks/states.$host" 2>/dev/null <<'REMOTE' &
for pid in $(pgrep -f -- "[-]-run-dir $1( |\$)"); do
  [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = mpirun ] && continue
  echo "$pid $(awk '{print $3}' /proc/"$pid"/stat)"
  if command -v py-spy >/dev/null; then
    py-spy dump --nonblocking --pid "$pid" > "$1/stacks/py-spy.$(hostname).$pid.txt" 2>&1 &
  fi
  kill -USR2 "$pid"
done
wait
REMOTE
    pids+=($!)
  done
  wait "${pids[@]}"  # not a bare wait: mpirun is a child too
  sleep 2  # faulthandler writes from a signal handler: give the ranks a moment
}
probe_all() {  # the health probe on every node of the original set, in parallel
  local host pids=()
  rm -rf "$RUN_DIR/probes" && mkdir -p "$RUN_DIR/probes"
  for host in $HOSTS; do
    timeout 30 ssh -F "$SSH_CONFIG" -o ConnectTimeout=5 "$host" bash -s < "$RUN_DIR/probe.sh" \
      > "$RUN_DIR/probes/$host" 2>/dev/null &
    pids+=($!)
  done
  wait "${pids[@]}"
}

# One attempt: mpirun under the watchdog. Sets code, reason (empty when mpirun ended by itself), kind.
attempt() {
  attempts=$((attempts + 1))
  echo "$(now) launcher: starting on $(hostname): $(cat "$RUN_DIR/command.sh")" >> "$LOG"
  rm -rf "$RUN_DIR/ranks" "$RUN_DIR/stacks" && mkdir -p "$RUN_DIR/ranks" "$RUN_DIR/stacks"
  bash "$RUN_DIR/command.sh" >> "$LOG" 2>&1 < /dev/null &
  mpirun_pid=$!
  echo "$mpirun_pid" > "$RUN_DIR/mpirun.pid"
  reason="" kind=""
  local host age beat window
  started=$(date +%s)  # global: the Spot check and the restart plan read it
  declare -A failures=()
  while kill -0 "$mpirun_pid" 2>/dev/null; do
    sleep "$POLL_SECONDS" &
    wait -n "$!" "$mpirun_pid" 2>/dev/null  # a poll interval, or less when mpirun ends (bash >= 5.1)
    kill "$!" 2>/dev/null
    kill -0 "$mpirun_pid" 2>/dev/null || break
    for host in $(hosts_in_use); do
      if timeout 15 ssh -F "$SSH_CONFIG" -o ConnectTimeout=5 "$host" true >/dev/null 2>&1; then
        failures[$host]=0
      else
        failures[$host]=$((${failures[$host]:-0} + 1))
        if ((failures[$host] >= UNREACHABLE_LIMIT)); then
          reason="node $host unreachable for $((UNREACHABLE_LIMIT * POLL_SECONDS))+ s" kind=unreachable
          break 2
        fi
      fi
    done
    beat=$(newest_beat)
    if ((beat >= started)); then
      age=$(($(date +%s) - beat)) window=$(hang_window)
      if ((age > window)); then
        collect_stacks
        reason="hang: no rank finished a step for $age s (window $window s); $("$PYTHON" "$RUN_DIR/supervise.py" hang "$RUN_DIR")"
        mv "$RUN_DIR/stacks" "$RUN_DIR/hang-stacks-$attempts"  # the next attempt starts a fresh stacks/
        reason+="; stacks in $RUN_DIR/hang-stacks-$attempts" kind=hang
        break
      fi
    elif [[ -f $RUN_DIR/progress.json && $(stat -c %Y "$RUN_DIR/progress.json") -ge $started ]]; then
      age=$(($(date +%s) - $(stat -c %Y "$RUN_DIR/progress.json")))
      if ((age > STALL_SECONDS)); then
        reason="no training progress for $age s" kind=hang
        break
      fi
    elif (($(date +%s) - started > START_SECONDS)); then
      reason="no training step within $START_SECONDS s of the start (mpirun or the data load is stuck: see train.log)"
      kind=start
      break
    fi
  done
  if [[ -n $reason ]]; then
    echo "$(now) watchdog: $reason; ending the attempt" >> "$LOG"
    kill -TERM "$mpirun_pid" 2>/dev/null
    for _ in 1 2 3 4 5; do kill -0 "$mpirun_pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$mpirun_pid" 2>/dev/null
  fi
  wait "$mpirun_pid"
  code=$?
  if [[ -n $reason ]] || ((code != 0)); then
    for host in $(hosts_in_use); do  # after any failure: no rank or daemon of this attempt survives
      cleanup "$host" || unreached+=" $host"
    done
  fi
  [[ -z $reason && $code != 0 ]] && kind=died
  echo "$(now) launcher: mpirun exited with $code" >> "$LOG"
}

cleanup() {  # cleanup HOST: this run's ranks and the MPI daemons (one run at a time per cluster)
  timeout 15 ssh -F "$SSH_CONFIG" -o ConnectTimeout=5 "$1" \
    "pkill -KILL -f -- '[-]-run-dir $RUN_DIR'; pkill -KILL -x orted; pkill -KILL -x prted; true" >/dev/null 2>&1
}

finish() {  # finish STATE EXIT_CODE REASON: --then-stop's stop request first, so its line is in the
  # log before the status tells a follower the run is over
  if [[ ${THEN_STOP:-0} == 1 ]]; then
    export CLUSTER_NAME AWS_REGION AWS_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_DEFAULT_REGION
    # AUTOSTOP: the watchdog's one-line command (PYTHONPATH=ROOT python -m cluster_node.autostop.watchdog)
    bash -c "$AUTOSTOP --stop-now" >> "$LOG" 2>&1 || echo "$(now) launcher: --then-stop failed" >> "$LOG"
  fi
  status "$@"
}

echo $$ > "$RUN_DIR/launcher.pid"
status running null ""
unreached="" attempts=0
rm -rf "$RUN_DIR"/hang-stacks-*
while true; do
  attempt
  # A clean end that came early because a node got a Spot notice: with restarts left, go on without it.
  if [[ -z $reason ]] && ((code == 0)) && ((${MAX_RESTARTS:-0} > 0)) &&
    spot=$("$PYTHON" "$RUN_DIR/supervise.py" spot "$RUN_DIR" "$started"); then
    reason=$spot kind=spot
  fi
  if [[ -f $RUN_DIR/FORCED ]]; then
    finish failed "$code" "stopped by fab stop --force"
  elif [[ -z $reason ]] && ((code == 0)); then
    finish finished 0 "$(grep -o 'run ended at step.*' "$LOG" | tail -n 1)"
  else
    [[ -z $reason ]] && reason=$(grep -E 'mpirun noticed|exited on signal|Error|error:' "$LOG" | tail -n 1)
    [[ $kind != died && $kind != spot ]] && reason="watchdog: $reason"
    if ((${MAX_RESTARTS:-0} > 0)); then
      probe_all
      if decision=$("$PYTHON" "$RUN_DIR/supervise.py" plan "$RUN_DIR" "$kind" "$reason" "$started" 2>&1); then
        echo "$(now) launcher: $reason; $decision" >> "$LOG"
        continue
      fi
      reason+="; $decision"
    fi
    finish failed "$code" "$reason"
  fi
  break
done
[[ $(cat "$ACTIVE_FILE" 2>/dev/null) == "$RUN_DIR" ]] && rm -f "$ACTIVE_FILE"

# A partitioned node keeps its MPI daemon until someone reaches it: retry for a while, unless a
# new run has started (its daemons must not be touched).
deadline=$(($(date +%s) + ${CLEANUP_SECONDS:-600}))
while [[ -n ${unreached// /} ]] && (($(date +%s) < deadline)) && [[ ! -s $ACTIVE_FILE ]]; do
  sleep 5
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
