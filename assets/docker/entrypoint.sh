#!/usr/bin/env bash
# Starts sshd on 4444 trusting the cluster identity (and the EC2 key pair, if given).
# Used by the training container and, unchanged, by each node of the emulated local cluster.
set -euo pipefail

DATA_DIR=${DATA_DIR:-/data}
CLUSTER_SSH_DIR=${CLUSTER_SSH_DIR:-$DATA_DIR/.cluster/ssh}
RUNTIME_DIR=${RUNTIME_DIR:-/run/gpu-cluster}
EXTRA_AUTHORIZED_KEYS=${EXTRA_AUTHORIZED_KEYS:-/etc/gpu-cluster/authorized_keys}
SSHD_CONFIG=${SSHD_CONFIG:-/etc/gpu-cluster/sshd_config}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# sshd gives a session (and so mpirun's daemons on the other nodes, and their ranks) a default
# environment, not the container's: the NGC image needs its own (OPAL_PREFIX for its relocated
# HPC-X Open MPI, CUDA/NCCL variables, PATH, LD_LIBRARY_PATH). Carry all of it, as `docker run`
# gave it to this entrypoint, minus what belongs to a session. sshd_config's SetEnv reaches every
# session, interactive or not, whatever the login shell: only its first line counts, each argument
# is "NAME=value", double quotes keep spaces. A double quote, backslash or line break in a value
# has no spelling that every OpenSSH parses alike: such a variable is left out, and logged.
session_setenv() {
  local name value line=""
  for name in $(compgen -e); do
    case $name in
      HOME | PWD | OLDPWD | SHLVL | HOSTNAME | _ | TERM | USER | LOGNAME | SHELL | MAIL | SSH_*) continue ;;
    esac
    value=${!name}
    if [[ $value == *[\"\\$'\n\r']* ]]; then
      echo "entrypoint: $name is not carried into SSH sessions: sshd_config cannot hold its value" >&2
      continue
    fi
    line+=" \"$name=$value\""
  done
  echo "SetEnv$line"
}

for ((waited = 0; ; waited++)); do
  [[ -f $CLUSTER_SSH_DIR/config ]] && break
  ((waited < 300)) || { echo "no cluster identity in $CLUSTER_SSH_DIR" >&2; exit 1; }
  sleep 1
done

install -d -m 0700 "$RUNTIME_DIR"
install -d -m 0700 "$RUNTIME_DIR/fab-ssh"  # fab's commands mark their connections here (not use)
install -d -m 0755 /run/sshd
install -m 0600 "$CLUSTER_SSH_DIR/ssh_host_ed25519_key" "$RUNTIME_DIR/ssh_host_ed25519_key"
{
  cat "$CLUSTER_SSH_DIR/authorized_keys"
  if [[ -s $EXTRA_AUTHORIZED_KEYS ]]; then cat "$EXTRA_AUTHORIZED_KEYS"; fi
} > "$RUNTIME_DIR/authorized_keys"
chmod 0600 "$RUNTIME_DIR/authorized_keys"
{
  cat "$SSHD_CONFIG"
  echo "HostKey $RUNTIME_DIR/ssh_host_ed25519_key"
  echo "AuthorizedKeysFile $RUNTIME_DIR/authorized_keys"
  echo "PidFile $RUNTIME_DIR/sshd.pid"
  session_setenv
} > "$RUNTIME_DIR/sshd_config"

# The autostop watchdog runs on every node (see cluster_node/daemons/autostop/watchdog.py; the image's
# PYTHONPATH=/workspace finds the package): each publishes its own heartbeat, so a dead head node
# cannot leave the others running. Restarted if it dies; exit 0 means it stopped the cluster. With
# IDLE_MINUTES=0 too (autostop off): it then says busy, and reads idle_minutes again from its SSM
# parameter, so a later `-c idle_minutes=N` applies here (the alarm that change creates finds beats).
if [[ -n ${IDLE_MINUTES:-} && -f /workspace/cluster_node/daemons/autostop/watchdog.py ]]; then
  (
    until python -m cluster_node.daemons.autostop.watchdog --data "$DATA_DIR"; do sleep 60; done
  ) >> "$DATA_DIR/.cluster/autostop-node${NODE_RANK:-0}.log" 2>&1 &
fi

# Spot nodes: the interruption watcher (cluster_node/daemons/spotwatch.py) polls the instance metadata
# and, on EC2's two-minute notice, makes the active run checkpoint at once. Restarted if it dies.
if [[ ${SPOT:-false} == true && -f /workspace/cluster_node/daemons/spotwatch.py ]]; then
  (
    until python -m cluster_node.daemons.spotwatch --data "$DATA_DIR"; do sleep 5; done
  ) >> "$DATA_DIR/.cluster/spot-node${NODE_RANK:-0}.log" 2>&1 &
fi

if (($#)); then
  exec "$@"
fi
exec /usr/sbin/sshd -D -e -f "$RUNTIME_DIR/sshd_config"
