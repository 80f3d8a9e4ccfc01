#!/usr/bin/env bash
# GPU cluster node bootstrap. Idempotent: a second run changes nothing.
#   node-bootstrap.sh /etc/gpu-cluster/bootstrap.env [bootstrap|reset-alarm|stop-failed]
# (reset-alarm: a unit at every boot; stop-failed: the timer a failed bootstrap leaves)
# Steps: docker + NVIDIA toolkit, EFS at /data (fstab), image context (S3), cluster SSH identity
# (once, on /data),
# base image pull, training image, training container (sshd on 4444), ready marker, CloudFormation signal.
# Each step's start and end go to $TIMELINE, copied to /data/.cluster/deploy/nodeN once ready.
# A failing command anywhere (a step function, a pipeline, a subshell, a command substitution)
# signals FAILURE once with the step's name and ends the bootstrap, so `cdk deploy` fails with it:
# errtrace (-E) carries the ERR trap into functions and subshells, inherit_errexit carries -e into
# command substitutions. Failures in `a && b` lists and `if` conditions do not trigger -e: steps
# put each command that must succeed on its own line.
set -eEuo pipefail
shopt -s inherit_errexit

ENV_FILE=${1:-/etc/gpu-cluster/bootstrap.env}
MODE=${2:-bootstrap}
# shellcheck source=/dev/null
source "$ENV_FILE"
: "${CLUSTER_NAME:?}" "${NODE_RANK:?}" "${FILE_SYSTEM_ID:?}" "${AWS_REGION:?}" "${STACK_NAME:?}"
: "${SIGNAL_RESOURCE:?}" "${BASE_IMAGE:?}" "${IMAGE_CONTEXT_PARAMETER:?}"
: "${HOST_KEY_PARAMETER:?}" "${IDLE_ALARM:?}" "${HEARTBEAT_NAMESPACE:?}" "${IDLE_MINUTES_PARAMETER:?}"

DATA_DIR=/data
STATE_DIR=/var/lib/gpu-cluster
CONTEXT_DIR=/opt/gpu-cluster/image-context
CLUSTER_SSH_DIR=$DATA_DIR/.cluster/ssh
CONTAINER=gpu-cluster-train
MOUNT_ATTEMPTS=${MOUNT_ATTEMPTS:-60}
MOUNT_RETRY_SECONDS=${MOUNT_RETRY_SECONDS:-10}
# unattended-upgrades holds the dpkg lock in the first minutes after boot: apt-get waits this long.
APT_LOCK_TIMEOUT=${APT_LOCK_TIMEOUT:-300}
APT_UPDATE_ATTEMPTS=${APT_UPDATE_ATTEMPTS:-30}
# nvcr.io's manifest or TLS can fail once in a ~10 GB pull; docker retries layers, not the pull itself.
PULL_ATTEMPTS=${PULL_ATTEMPTS:-5}
PULL_RETRY_SECONDS=${PULL_RETRY_SECONDS:-30}
EFA_DEVICES=${EFA_DEVICES:-/dev/infiniband}  # one uverbsN per EFA interface (the host's efa driver)
UNITS=/etc/systemd/system
DOCKER_DROPIN=$UNITS/docker.service.d/gpu-cluster-data.conf
DOCKER_CONFIG=/etc/docker/daemon.json
SELF=/usr/local/sbin/gpu-cluster-bootstrap
KEEP_RUNNING=$STATE_DIR/keep-running
FAILED_STOP_MARKER=/run/gpu-cluster/failed-stop  # gone at a reboot, like the transient timer it marks
FAILED_STOP_MINUTES=45
IMDS=http://169.254.169.254/latest
STEP=$MODE
# The deploy timeline on the local disk: it exists before /data and survives a failed mount.
TIMELINE=$STATE_DIR/deploy-timeline
STEP_START=

log() { echo "$(date -u +%FT%TZ) [node$NODE_RANK/$STEP] $*"; }

imds() {
  local token
  token=$(curl -sf -X PUT "$IMDS/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: 300")
  curl -sf -H "X-aws-ec2-metadata-token: $token" "$IMDS/$1"
}

signal() {  # signal STATUS: CloudFormation shows the UniqueId, so it carries the failed step.
  local instance_id
  instance_id=$(imds meta-data/instance-id || echo unknown)
  aws cloudformation signal-resource --region "$AWS_REGION" --stack-name "$STACK_NAME" \
    --logical-resource-id "$SIGNAL_RESOURCE" --status "$1" \
    --unique-id "${instance_id}${2:+-failed-$2}"
}

on_error() {  # runs where the command failed: the main shell or a subshell of it (same STEP)
  local code=$?
  trap - ERR
  exec >&2  # in a command substitution stdout is captured; the log is on stderr
  log "FAILED (exit $code); see $STATE_DIR/bootstrap.log"
  [[ -z $STEP_START ]] || echo "$STEP $STEP_START $EPOCHREALTIME failed" >> "$TIMELINE"
  signal FAILURE "$STEP" || log "could not signal CloudFormation"
  schedule_failed_stop || log "could not schedule this node's stop"
  # A subshell ends the main script too: it must neither go on nor signal a second time.
  [[ $BASHPID == "$$" ]] || kill -TERM "$$"
  exit "$code"
}

# A failed node has no watchdog and no alarm (created after SUCCESS): with `cdk deploy --no-rollback`
# it would bill on. It stops itself later, time enough to log in and read the log, unless kept.
schedule_failed_stop() {
  # A node that once signalled success has its watchdog and alarm: a failed re-run by hand stops nothing.
  [[ -f $STATE_DIR/signalled ]] && { log "this node bootstrapped before: its watchdog still applies"; return 0; }
  [[ -f $FAILED_STOP_MARKER ]] && return 0
  systemd-run --unit=gpu-cluster-failed-stop --on-active="${FAILED_STOP_MINUTES}min" \
    --description="GPU cluster: stop this node, its bootstrap failed" "$SELF" "$ENV_FILE" stop-failed
  install -d -m 0755 "${FAILED_STOP_MARKER%/*}"
  touch "$FAILED_STOP_MARKER"
  log "this node stops itself in $FAILED_STOP_MINUTES min; to keep it: sudo touch $KEEP_RUNNING"
}

stop_failed() {
  if [[ -e $KEEP_RUNNING ]]; then log "$KEEP_RUNNING exists: not stopping"; return 0; fi
  log "the bootstrap failed or did not finish: stopping this node"
  # StopInstances stops whatever the instance's shutdown behaviour, and persistent Spot allows a stop.
  aws ec2 stop-instances --region "$AWS_REGION" --instance-ids "$(imds meta-data/instance-id)" >/dev/null \
    || systemctl poweroff  # EBS-backed: an OS shutdown stops by default
}

# A bootstrap that hangs (a stalled pull or build) fails nothing: no ERR trap, no scheduled stop.
# A timer armed at its start stops the node 90 min later (the signal's 45 min timeout, then 45 min to
# look); enabled, so every later boot arms it again until the node is ready (a transient one dies
# with a reboot, and user data runs only once).
arm_deadline() {
  [[ -f $STATE_DIR/signalled ]] && return 0
  local unit=$UNITS/gpu-cluster-deadline changed=0
  install_unit "$unit.service" "$(printf '%s\n' "[Service]" "Type=oneshot" "ExecStart=$SELF $ENV_FILE stop-failed")" \
    && changed=1
  install_unit "$unit.timer" "$(printf '%s\n' "[Timer]" "OnActiveSec=90min" "[Install]" "WantedBy=timers.target")" \
    && changed=1
  if ((changed)); then systemctl daemon-reload; fi
  # Active already (a run by hand): its deadline stays.
  systemctl enable --now gpu-cluster-deadline.timer
  log "stops in 90 min unless ready (touch $KEEP_RUNNING keeps it)"
}

# Ready: no deadline; a stop that a failed run scheduled (then run again by hand) is cancelled.
cancel_failed_stop() {
  if [[ -f $UNITS/gpu-cluster-deadline.timer ]]; then
    systemctl disable --now gpu-cluster-deadline.timer
    rm -f "$UNITS"/gpu-cluster-deadline.{timer,service}
    systemctl daemon-reload
  fi
  [[ -f $FAILED_STOP_MARKER ]] || return 0
  systemctl stop gpu-cluster-failed-stop.timer || true
  rm -f "$FAILED_STOP_MARKER"
  log "the scheduled stop is cancelled"
}

# busy_beat ID: one busy beat, then a wait (5 min at most) until CloudWatch serves it. Once a boot
# (/run is emptied at a boot): a reset that fails and is run again must not beat busy forever.
busy_beat() {
  # --unit: the watchdog's (BUSY_UNIT); a beat without one is a series of its own the alarm may not read.
  local metric=(--region "$AWS_REGION" --namespace "$HEARTBEAT_NAMESPACE" --metric-name Busy --unit Count) attempt
  [[ -f /run/gpu-cluster/beat ]] && return 0
  aws cloudwatch put-metric-data "${metric[@]}" --dimensions "InstanceId=$1" --value 1
  install -d /run/gpu-cluster
  touch /run/gpu-cluster/beat
  for ((attempt = 1; attempt <= 30; attempt++)); do
    [[ $(aws cloudwatch get-metric-statistics "${metric[@]}" --dimensions "Name=InstanceId,Value=$1" \
      --start-time "$(date -u -d -10min +%FT%TZ)" --end-time "$(date -u -d +1min +%FT%TZ)" --period 60 \
      --statistics Maximum --query 'max(Datapoints[].Maximum)' --output text) == 1* ]] && return 0
    sleep 10
  done
  log "beat not served after 5 min; going on"
}

# An alarm acts only on a change of state: one left in ALARM by a long stop never stops the node
# again. At every boot (a host unit: the container may never come back) it goes back to OK, after a
# busy beat CloudWatch already serves; else it would be ALARM again within seconds, the window
# being all missing (breaching) data, and stop the node it just let start.
# Any failure exits non-zero: its unit (Restart=on-failure) runs it again until the alarm is reset.
reset_alarm() {
  local id error
  id=$(imds meta-data/instance-id)
  busy_beat "$id"
  if ! error=$(aws cloudwatch set-alarm-state --region "$AWS_REGION" --alarm-name "$IDLE_ALARM" \
    --state-value OK --state-reason "node $id booted" 2>&1); then
    [[ $error == *ResourceNotFound* ]] || { log "$error"; return 1; }
    log "no idle alarm $IDLE_ALARM (idle_minutes=0): nothing to reset"
  fi
}

apt_get() {
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout="$APT_LOCK_TIMEOUT" -yq "$@"
}

apt_install() {
  # The package lists lock has no timeout option: retry `update` while another apt holds it.
  local attempt
  for ((attempt = 1; ; attempt++)); do
    if apt_get update; then break; fi
    ((attempt < APT_UPDATE_ATTEMPTS)) || { log "apt-get update failed $attempt times"; return 1; }
    log "apt-get update failed (attempt $attempt/$APT_UPDATE_ATTEMPTS); package lists locked?"
    sleep 10
  done
  apt_get install "$@"
}

ensure_docker() {
  STEP=docker
  if ! command -v docker >/dev/null; then
    log "installing docker"
    apt_install docker.io
  fi
  if ! command -v nvidia-ctk >/dev/null; then
    log "installing the NVIDIA container toolkit"
    apt_install nvidia-container-toolkit
    nvidia-ctk runtime configure --runtime=docker
  fi
  local config driver
  config=$(cgroupfs_config)  # an assignment, not a condition: a failed merge fails the step (-e, ERR)
  if install_unit "$DOCKER_CONFIG" "$config"; then
    log "docker: the cgroupfs cgroup driver (a daemon-reload then leaves the container its GPUs)"
    systemctl restart docker
  fi
  systemctl enable --now docker
  driver=$(docker info -f '{{.CgroupDriver}}')
  [[ $driver == cgroupfs ]] || { log "docker uses the $driver cgroup driver, not cgroupfs ($DOCKER_CONFIG)"; return 1; }
}

# With Docker's systemd cgroup driver, any `systemctl daemon-reload` (this script's, a package's) takes
# a running container's GPU devices away: "Failed to initialize NVML: Unknown Error" until the
# container is created again (NVIDIA/nvidia-container-toolkit#48; cgroupfs is NVIDIA's Docker
# workaround). The AMI's daemon.json with it merged in (its nvidia runtime stays).
cgroupfs_config() {
  python3 -c '
import json, sys
try:
    with open(sys.argv[1]) as f:
        config = json.load(f)
except FileNotFoundError:
    config = {}
opts = [o for o in config.get("exec-opts", []) if not o.startswith("native.cgroupdriver=")]
config["exec-opts"] = opts + ["native.cgroupdriver=cgroupfs"]
print(json.dumps(config, indent=2))' "$DOCKER_CONFIG"
}

# install_unit PATH CONTENT: write it if it changed; 0 when it did
install_unit() {
  [[ -f $1 && $(< "$1") == "$2" ]] && return 1
  install -d -m 0755 "$(dirname "$1")"
  printf '%s\n' "$2" > "$1.tmp"
  mv "$1.tmp" "$1"
}

boot_units() {
  # systemd.mount(5) has no Restart=: a /data mount that fails once at boot (DNS, the mount target)
  # would stay failed, and dockerd (whose container, --restart unless-stopped, needs /data) with it.
  # This oneshot retries until /data is mounted; dockerd's start waits for it (After=).
  local changed=0 retry="until mountpoint -q $DATA_DIR || mount $DATA_DIR; do sleep 10; done"
  install_unit "$UNITS/gpu-cluster-data.service" "$(printf '%s\n' "[Unit]" \
    "Description=GPU cluster: mount $DATA_DIR (EFS), retrying until it is mounted" \
    "Wants=network-online.target" "After=network-online.target data.mount" "[Service]" "Type=oneshot" \
    "RemainAfterExit=yes" "TimeoutStartSec=infinity" "ExecStart=/bin/sh -c '$retry'" \
    "[Install]" "WantedBy=multi-user.target")" && changed=1
  # The DLAMI's dlami-nvme.service (WantedBy=multi-user.target) makes and mounts the instance store at every
  # boot (a stop erases it): the container's bind of it comes after. After= only: where an AMI lacks the unit,
  # or disabled it to manage its disks itself, it orders nothing and starts nothing.
  install_unit "$DOCKER_DROPIN" "$(printf '%s\n' "[Unit]" "Requires=gpu-cluster-data.service" \
    "After=gpu-cluster-data.service dlami-nvme.service")" && changed=1
  install_unit "$UNITS/gpu-cluster-idle-alarm.service" "$(printf '%s\n' "[Unit]" \
    "Description=GPU cluster: this node's idle alarm back to OK at boot" \
    "Wants=network-online.target" "After=network-online.target" "[Service]" "Type=oneshot" \
    "ExecStart=$SELF $ENV_FILE reset-alarm" "Restart=on-failure" "RestartSec=30" \
    "[Install]" "WantedBy=multi-user.target")" && changed=1
  ((changed)) || return 0
  log "boot units: $DATA_DIR mount with retries (dockerd after it), idle alarm reset"
  systemctl daemon-reload
  systemctl enable gpu-cluster-data.service gpu-cluster-idle-alarm.service
}

mount_efs() {
  STEP=mount-efs
  local source="$FILE_SYSTEM_ID.efs.$AWS_REGION.amazonaws.com:/"
  # AWS's recommended options, _netdev and nofail (boot even without it); lookupcache=positive:
  # a name not found is asked again, so a STOP written from another node shows at once (nfs(5)).
  local options=nfsvers=4.1,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,noresvport,_netdev
  options+=,nofail,lookupcache=positive
  command -v mount.nfs4 >/dev/null || apt_install nfs-common
  install -d -m 0755 "$DATA_DIR"
  if ! awk -v dir="$DATA_DIR" '$2 == dir { found = 1 } END { exit !found }' /etc/fstab; then
    log "adding $DATA_DIR to /etc/fstab"
    echo "$source $DATA_DIR nfs4 $options 0 0" >> /etc/fstab
  fi
  boot_units
  local attempt
  for ((attempt = 1; attempt <= MOUNT_ATTEMPTS; attempt++)); do
    if mountpoint -q "$DATA_DIR" || mount "$DATA_DIR"; then return 0; fi
    log "mount attempt $attempt/$MOUNT_ATTEMPTS failed; mount target not ready yet?"
    sleep "$MOUNT_RETRY_SECONDS"
  done
  log "EFS $FILE_SYSTEM_ID did not mount at $DATA_DIR"
  return 1
}

create_cluster_identity() {
  STEP=cluster-identity
  bash "$CONTEXT_DIR/docker/cluster-identity.sh" "$DATA_DIR" "$CLUSTER_NAME"
  if [[ $NODE_RANK == 0 && ! -f $STATE_DIR/host-key-published ]]; then
    local host_key
    host_key=$(cat "$CLUSTER_SSH_DIR/ssh_host_ed25519_key.pub")
    aws ssm put-parameter --region "$AWS_REGION" --name "$HOST_KEY_PARAMETER" --type String \
      --overwrite --value "$host_key" >/dev/null
    touch "$STATE_DIR/host-key-published"
  fi
  # The EC2 key pair's public key lets fab (on the user's machine) into the container as well.
  if [[ ! -s /etc/gpu-cluster/authorized_keys ]]; then
    local user_key
    user_key=$(imds meta-data/public-keys/0/openssh-key)
    printf '%s\n' "$user_key" > /etc/gpu-cluster/authorized_keys.tmp
    mv /etc/gpu-cluster/authorized_keys.tmp /etc/gpu-cluster/authorized_keys
  fi
}

fetch_image_context() {  # the parameter holds "S3_URL TAG"; not in user data, so code edits replace no node
  STEP=image-context
  local value
  value=$(aws ssm get-parameter --region "$AWS_REGION" --name "$IMAGE_CONTEXT_PARAMETER" \
    --query Parameter.Value --output text)
  read -r IMAGE_CONTEXT_URL IMAGE_TAG <<< "$value"
  IMAGE=gpu-cluster-train:$IMAGE_TAG
  [[ -f $CONTEXT_DIR/.tag && $(cat "$CONTEXT_DIR/.tag") == "$IMAGE_TAG" ]] && return 0
  log "fetching the image context $IMAGE_CONTEXT_URL"
  command -v unzip >/dev/null || apt_install unzip
  rm -rf "$CONTEXT_DIR"
  install -d "$CONTEXT_DIR"
  aws s3 cp --region "$AWS_REGION" --only-show-errors "$IMAGE_CONTEXT_URL" "$CONTEXT_DIR.zip"
  unzip -q -o "$CONTEXT_DIR.zip" -d "$CONTEXT_DIR"
  rm -f "$CONTEXT_DIR.zip"
  echo "$IMAGE_TAG" > "$CONTEXT_DIR/.tag"
}

# Its own step so the timeline tells the download from the build; `docker build` (no --pull) then
# uses the local base image.
pull_image() {
  STEP=pull-image
  docker image inspect "$IMAGE" >/dev/null 2>&1 && return 0
  log "pulling $BASE_IMAGE"
  local attempt
  for ((attempt = 1; ; attempt++)); do
    if docker pull -q "$BASE_IMAGE" >/dev/null; then return 0; fi
    ((attempt < PULL_ATTEMPTS)) || { log "docker pull failed $attempt times"; return 1; }
    log "docker pull failed (attempt $attempt/$PULL_ATTEMPTS); again in ${PULL_RETRY_SECONDS}s"
    sleep "$PULL_RETRY_SECONDS"
  done
}

build_image() {
  STEP=build-image
  docker image inspect "$IMAGE" >/dev/null 2>&1 && return 0
  log "building $IMAGE from $BASE_IMAGE"
  # EFA's user space (the installer) only in an EFA node's image
  docker build --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "EFA=$((${EFA_CARDS:-0} > 0))" -t "$IMAGE" \
    -f "$CONTEXT_DIR/docker/Dockerfile" "$CONTEXT_DIR"
}

start_container() {
  STEP=start-container
  if [[ $(docker inspect -f '{{.State.Running}} {{.Config.Image}}' "$CONTAINER" 2>/dev/null) == "true $IMAGE" ]]; then
    return 0
  fi
  log "starting $CONTAINER"
  # The watchdog's idle minutes live in the stack's SSM parameter, not in user data (a change there
  # would replace the node): read when the container is (re)created.
  local idle_minutes
  idle_minutes=$(aws ssm get-parameter --region "$AWS_REGION" --name "$IDLE_MINUTES_PARAMETER" \
    --query Parameter.Value --output text)
  [[ $idle_minutes =~ ^[0-9]+$ ]] || { log "$IDLE_MINUTES_PARAMETER is not a number: '$idle_minutes'"; return 1; }
  docker rm -f "$CONTAINER" >/dev/null 2>&1 || true
  # The instance store (DLAMI: /opt/dlami/nvme), for data staged with --stage-to; erased by a stop. rslave: a
  # mount the host makes there after the container starts reaches it too (a bind is rprivate by default).
  local store=${INSTANCE_STORE:-/opt/dlami/nvme} instance_store=()
  if [[ -d $store ]]; then instance_store=(-v "$store:$store:rslave"); fi
  # EFA: the devices only. The image has its own libfabric, rdma-core and aws-ofi-nccl (the host's
  # need the host's rdma-core and hwloc, which the container lacks).
  local efa=() device
  if ((${EFA_CARDS:-0} > 0)); then
    for device in "$EFA_DEVICES"/uverbs*; do [[ -e $device ]] && efa+=(--device "$device"); done
    # A node short of its EFA devices fails here, named, not at the first fab train (NCCL_NET=OFI).
    if ((${#efa[@]} / 2 < EFA_CARDS)); then
      log "EFA: $((${#efa[@]} / 2)) of $EFA_CARDS devices in $EFA_DEVICES (the host's efa driver: lsmod | grep efa)"
      return 1
    fi
  fi
  # SYSLOG: the health probe's dmesg (its Xid check); Docker's default seccomp profile allows syslog(2)
  # only with CAP_SYSLOG. nofile: Docker 25+ leaves a container systemd's soft 1024 open files, and NCCL's
  # socket transport (16 sockets a peer and channel) and DataLoader workers' shared tensors go past it.
  # The instance id for the watchdog's heartbeat (its alarm's dimension) and its stop of this node last: fixed for
  # the instance's life, as the container is (a replaced node bootstraps a new one). Empty: the watchdog asks IMDS.
  local instance_id
  instance_id=$(imds meta-data/instance-id || true)
  docker run -d --name "$CONTAINER" --restart unless-stopped \
    --gpus all --net=host --ipc=host --shm-size=16g --cap-add SYS_PTRACE --cap-add SYSLOG \
    --ulimit memlock=-1 --ulimit stack=67108864 --ulimit nofile=1048576:1048576 \
    -e "NODE_RANK=$NODE_RANK" -e "CLUSTER_NAME=$CLUSTER_NAME" -e "INSTANCE_ID=$instance_id" \
    -e "IDLE_MINUTES=$idle_minutes" -e "SPOT=${SPOT:-false}" -e "AWS_REGION=$AWS_REGION" -e "AWS_DEFAULT_REGION=$AWS_REGION" \
    -v "$DATA_DIR:$DATA_DIR" -v /etc/gpu-cluster/authorized_keys:/etc/gpu-cluster/authorized_keys:ro \
    "${instance_store[@]}" "${efa[@]}" "$IMAGE" >/dev/null
  local waited=0
  until docker exec "$CONTAINER" pgrep -x sshd >/dev/null; do
    ((waited++ < 30)) || { log "sshd did not start in $CONTAINER"; return 1; }
    sleep 2
  done
}

mark_ready() {
  STEP=ready
  gpus_in_container  # before the deadline is cancelled: a node that fails here still stops itself
  cancel_failed_stop
  install -d -m 0755 "$DATA_DIR/.cluster/ready"
  # TIME INSTANCE_ID: the idle watchdog holds its stop while a node no mark names is bootstrapping (a
  # deploy adding or replacing nodes); a node replaced under this rank writes its own.
  local mark=$DATA_DIR/.cluster/ready/node$NODE_RANK instance_id
  instance_id=$(imds meta-data/instance-id)
  [[ " $(cat "$mark" 2>/dev/null) " == *" $instance_id "* ]] || echo "$(date -u +%FT%TZ) $instance_id" > "$mark"
  if [[ ! -f $STATE_DIR/signalled ]]; then
    # The idle alarm is created right after this signal, over a window of missing (breaching) data.
    busy_beat "$(imds meta-data/instance-id)"
    signal SUCCESS
    touch "$STATE_DIR/signalled"
  fi
  log "node ready"
}

# Every GPU the host sees, seen in the container too: a node that lost them (or never got them) fails
# here, named, not at the first fab train (which would find no CUDA device).
gpus_in_container() {
  local host seen
  host=$(nvidia-smi -L | grep -c '^GPU ' || true)
  ((host > 0)) || { log "the host sees no GPU (nvidia-smi -L): the NVIDIA driver is not loaded"; return 1; }
  seen=$(docker exec "$CONTAINER" nvidia-smi -L 2>&1 | grep -c '^GPU ' || true)
  ((seen == host)) || {
    log "$CONTAINER sees $seen of the host's $host GPUs (nvidia-smi -L in it and on the host)"
    return 1
  }
}

# timed STEP FUNCTION: "STEP START END" (epoch s) into the local timeline
timed() {
  STEP=$1 STEP_START=$EPOCHREALTIME
  "$2"
  echo "$STEP $STEP_START $EPOCHREALTIME" >> "$TIMELINE"
  STEP_START=
}

publish_timeline() {  # where `fab status` reads it: a node's own file, replaced whole
  local deploy=$DATA_DIR/.cluster/deploy
  install -d -m 0755 "$deploy"
  cp "$TIMELINE" "$deploy/.node$NODE_RANK.tmp"
  mv "$deploy/.node$NODE_RANK.tmp" "$deploy/node$NODE_RANK"
}

case $MODE in
  bootstrap) ;;
  reset-alarm) reset_alarm; exit ;;
  stop-failed) stop_failed; exit ;;
  *) echo "unknown mode $MODE: bootstrap, reset-alarm or stop-failed" >&2; exit 2 ;;
esac
install -d -m 0755 "$STATE_DIR"
exec > >(tee -a "$STATE_DIR/bootstrap.log") 2>&1
trap on_error ERR
: > "$TIMELINE"
arm_deadline
timed docker ensure_docker
timed mount-efs mount_efs
timed image-context fetch_image_context
timed cluster-identity create_cluster_identity
timed pull-image pull_image
timed build-image build_image
timed start-container start_container
timed ready mark_ready
# After the success signal: a failed copy must not signal a failure too.
publish_timeline || log "could not copy $TIMELINE to $DATA_DIR/.cluster/deploy"
