#!/usr/bin/env bash
# GPU cluster node bootstrap. Idempotent: a second run changes nothing.
#   node-bootstrap.sh /etc/gpu-cluster/bootstrap.env
# Steps: docker + NVIDIA toolkit, EFS at /data (fstab), image context (S3), cluster SSH identity
# (once, on /data),
# training image, training container (sshd on 4444), ready marker, CloudFormation signal.
# A failing step signals FAILURE with the step's name, so `cdk deploy` fails with it.
set -euo pipefail

ENV_FILE=${1:-/etc/gpu-cluster/bootstrap.env}
# shellcheck source=/dev/null
source "$ENV_FILE"
: "${CLUSTER_NAME:?}" "${NODE_RANK:?}" "${FILE_SYSTEM_ID:?}" "${AWS_REGION:?}" "${STACK_NAME:?}"
: "${SIGNAL_RESOURCE:?}" "${BASE_IMAGE:?}" "${IMAGE_CONTEXT_PARAMETER:?}"
: "${HOST_KEY_PARAMETER:?}"

DATA_DIR=/data
STATE_DIR=/var/lib/gpu-cluster
CONTEXT_DIR=/opt/gpu-cluster/image-context
CLUSTER_SSH_DIR=$DATA_DIR/.cluster/ssh
CONTAINER=gpu-cluster-train
MOUNT_ATTEMPTS=${MOUNT_ATTEMPTS:-60}
MOUNT_RETRY_SECONDS=${MOUNT_RETRY_SECONDS:-10}
IMDS=http://169.254.169.254/latest

install -d -m 0755 "$STATE_DIR"
exec > >(tee -a "$STATE_DIR/bootstrap.log") 2>&1
STEP=start

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

on_error() {
  local code=$?
  trap - ERR
  log "FAILED (exit $code); see $STATE_DIR/bootstrap.log"
  signal FAILURE "$STEP" || log "could not signal CloudFormation"
  exit "$code"
}
trap on_error ERR

ensure_docker() {
  STEP=docker
  if ! command -v docker >/dev/null; then
    log "installing docker"
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq docker.io
  fi
  if ! command -v nvidia-ctk >/dev/null; then
    log "installing the NVIDIA container toolkit"
    DEBIAN_FRONTEND=noninteractive apt-get install -yq nvidia-container-toolkit
    nvidia-ctk runtime configure --runtime=docker
  fi
  systemctl enable --now docker
}

mount_efs() {
  STEP=mount-efs
  local source="$FILE_SYSTEM_ID.efs.$AWS_REGION.amazonaws.com:/"
  local options=nfsvers=4.1,rsize=1048576,wsize=1048576,hard,timeo=600,retrans=2,noresvport,_netdev
  command -v mount.nfs4 >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -yq nfs-common
  install -d -m 0755 "$DATA_DIR"
  if ! awk -v dir="$DATA_DIR" '$2 == dir { found = 1 } END { exit !found }' /etc/fstab; then
    log "adding $DATA_DIR to /etc/fstab"
    echo "$source $DATA_DIR nfs4 $options 0 0" >> /etc/fstab
  fi
  local attempt
  for ((attempt = 1; attempt <= MOUNT_ATTEMPTS; attempt++)); do
    mountpoint -q "$DATA_DIR" && return 0
    mount "$DATA_DIR" && return 0
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
    aws ssm put-parameter --region "$AWS_REGION" --name "$HOST_KEY_PARAMETER" --type String \
      --overwrite --value "$(cat "$CLUSTER_SSH_DIR/ssh_host_ed25519_key.pub")" >/dev/null
    touch "$STATE_DIR/host-key-published"
  fi
  # The EC2 key pair's public key lets fab (on the user's machine) into the container as well.
  if [[ ! -s /etc/gpu-cluster/authorized_keys ]]; then
    imds meta-data/public-keys/0/openssh-key > /etc/gpu-cluster/authorized_keys.tmp
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
  command -v unzip >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -yq unzip
  rm -rf "$CONTEXT_DIR" && install -d "$CONTEXT_DIR"
  aws s3 cp --region "$AWS_REGION" --only-show-errors "$IMAGE_CONTEXT_URL" "$CONTEXT_DIR.zip"
  (cd "$CONTEXT_DIR" && unzip -q -o "$CONTEXT_DIR.zip") && rm -f "$CONTEXT_DIR.zip"
  echo "$IMAGE_TAG" > "$CONTEXT_DIR/.tag"
}

build_image() {
  STEP=build-image
  docker image inspect "$IMAGE" >/dev/null 2>&1 && return 0
  log "building $IMAGE from $BASE_IMAGE"
  docker build --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$IMAGE" -f "$CONTEXT_DIR/docker/Dockerfile" "$CONTEXT_DIR"
}

start_container() {
  STEP=start-container
  if [[ $(docker inspect -f '{{.State.Running}} {{.Config.Image}}' "$CONTAINER" 2>/dev/null) == "true $IMAGE" ]]; then
    return 0
  fi
  log "starting $CONTAINER"
  docker rm -f "$CONTAINER" >/dev/null 2>&1 || true
  # The instance store (DLAMI: /opt/dlami/nvme), for data staged with --stage-to; erased by a stop.
  local store=${INSTANCE_STORE:-/opt/dlami/nvme} instance_store=()
  if [[ -d $store ]]; then instance_store=(-v "$store:$store"); fi
  # EFA: the devices, and the host's libfabric and aws-ofi-nccl (the DLAMI's EFA installer) for NCCL.
  local efa=() device
  if ((${EFA_CARDS:-0} > 0)); then
    for device in /dev/infiniband/uverbs*; do [[ -e $device ]] && efa+=(--device "$device"); done
    efa+=(-v /opt/amazon/efa:/opt/amazon/efa:ro -v /opt/amazon/ofi-nccl:/opt/amazon/ofi-nccl:ro)
  fi
  docker run -d --name "$CONTAINER" --restart unless-stopped \
    --gpus all --net=host --ipc=host --shm-size=16g \
    --ulimit memlock=-1 --ulimit stack=67108864 \
    -e "NODE_RANK=$NODE_RANK" -e "CLUSTER_NAME=$CLUSTER_NAME" \
    -e "IDLE_MINUTES=${IDLE_MINUTES:-0}" -e "AWS_REGION=$AWS_REGION" -e "AWS_DEFAULT_REGION=$AWS_REGION" \
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
  install -d -m 0755 "$DATA_DIR/.cluster/ready"
  [[ -f $DATA_DIR/.cluster/ready/node$NODE_RANK ]] || date -u +%FT%TZ > "$DATA_DIR/.cluster/ready/node$NODE_RANK"
  if [[ ! -f $STATE_DIR/signalled ]]; then
    signal SUCCESS
    touch "$STATE_DIR/signalled"
  fi
  log "node ready"
}

ensure_docker
mount_efs
fetch_image_context
create_cluster_identity
build_image
start_container
mark_ready
