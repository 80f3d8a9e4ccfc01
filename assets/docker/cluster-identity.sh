#!/usr/bin/env bash
# Creates the cluster's internal SSH identity once, on shared storage, without a race between nodes:
#   cluster-identity.sh DATA_DIR CLUSTER_NAME
# mkdir is the lock; the winner writes into a temp dir and publishes it with one rename; the
# others wait for it. Writes: id_ed25519 (the cluster's client key), ssh_host_ed25519_key (one host
# key for every node), authorized_keys, known_hosts ("[*]:4444 ..."), and an ssh config for mpirun.
set -euo pipefail

DATA_DIR=${1:?usage: cluster-identity.sh DATA_DIR CLUSTER_NAME}
CLUSTER_NAME=${2:?usage: cluster-identity.sh DATA_DIR CLUSTER_NAME}
SSH_DIR=$DATA_DIR/.cluster/ssh
WAIT_SECONDS=${WAIT_SECONDS:-240}

install -d -m 0700 "$DATA_DIR/.cluster"
if [[ ! -f $SSH_DIR/config ]] && mkdir "$DATA_DIR/.cluster/ssh.lock" 2>/dev/null; then
  tmp=$(mktemp -d "$DATA_DIR/.cluster/ssh.tmp.XXXXXX")
  chmod 0700 "$tmp"
  ssh-keygen -q -t ed25519 -N "" -C "$CLUSTER_NAME-cluster" -f "$tmp/id_ed25519"
  ssh-keygen -q -t ed25519 -N "" -C "$CLUSTER_NAME-host" -f "$tmp/ssh_host_ed25519_key"
  cp "$tmp/id_ed25519.pub" "$tmp/authorized_keys"
  echo "[*]:4444 $(cut -d' ' -f1,2 "$tmp/ssh_host_ed25519_key.pub")" > "$tmp/known_hosts"
  cat > "$tmp/config" <<CONFIG
Host *
  Port 4444
  User root
  IdentityFile $SSH_DIR/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $SSH_DIR/known_hosts
  StrictHostKeyChecking yes
  BatchMode yes
  ConnectTimeout 10
  ServerAliveInterval 10
  ServerAliveCountMax 3
CONFIG
  mv -T "$tmp" "$SSH_DIR"
fi
for ((waited = 0; waited < WAIT_SECONDS; waited++)); do
  [[ -f $SSH_DIR/config ]] && exit 0
  sleep 1
done
echo "cluster identity never appeared in $SSH_DIR (a stale $DATA_DIR/.cluster/ssh.lock?)" >&2
exit 1
