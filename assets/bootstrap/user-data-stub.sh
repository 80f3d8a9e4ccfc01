#!/usr/bin/env bash
# The user-data stub's body (stacks/bootstrap.py render_user_data puts it after the node's env heredoc,
# which defines ENV_FILE and SCRIPT and writes "$ENV_FILE.new"). It reads the node config (KEY=VALUE
# lines of plain values: the file is sourced as root), fetches the bootstrap and runs it. Run by plain
# bash (cloud-init runs user data so; the deploy rehearsal too). Any exit before the bootstrap takes
# over (set -e, set -u, a failed exec) signals FAILURE with its step, so `cdk deploy` fails at once
# instead of after the creation policy's 45 minutes; and, as a failed bootstrap does, schedules the node's
# own stop in 45 minutes: with `cdk deploy --no-rollback` nothing else would ever stop it (no watchdog, no
# alarm yet). /var/lib/gpu-cluster/keep-running keeps it; a node that bootstrapped before is not stopped.
# The stop is StopInstances on itself (a stop whatever the shutdown behaviour; persistent Spot allows it),
# else poweroff; the stub leaves the bootstrap's mark of a scheduled stop, so a later success cancels it.
# execfail: a failed exec (a bad interpreter line) returns, and set -e ends the stub through its trap;
# without it bash would exit at once, trap and signal skipped.
: "${ENV_FILE:?}" "${SCRIPT:?}"
# shellcheck source=/dev/null
source "$ENV_FILE.new"
STEP=fetch-config
fail() {
  local status=$? imds=http://169.254.169.254/latest token id state=/var/lib/gpu-cluster
  ((status)) || return 0
  echo "gpu-cluster user data: $STEP failed (exit $status)" >&2
  token=$(curl -sf -X PUT "$imds/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: 300") || token=
  id=$(curl -sf -H "X-aws-ec2-metadata-token: $token" "$imds/meta-data/instance-id") || id=unknown
  aws cloudformation signal-resource --region "$AWS_REGION" --stack-name "$STACK_NAME" \
    --logical-resource-id "$SIGNAL_RESOURCE" --status FAILURE --unique-id "$id-failed-$STEP" || true
  [[ -f $state/signalled ]] && return
  systemd-run --unit=gpu-cluster-failed-stop --on-active=45min --description="GPU cluster: user data failed" \
    /bin/sh -c "test -e $state/keep-running || aws ec2 stop-instances --region $AWS_REGION \
--instance-ids $id >/dev/null || systemctl poweroff" || true
  { install -d -m 0755 /run/gpu-cluster && touch /run/gpu-cluster/failed-stop; } || true
  echo "gpu-cluster user data: this node stops itself in 45 min; to keep it: sudo touch $state/keep-running" >&2
}
trap fail EXIT
# The stub's calls come first at boot: the instance profile's credentials, the NAT route or an endpoint may
# come seconds later (aws/aws-cli#1325). Each call is tried for 3 minutes before the step fails.
export AWS_METADATA_SERVICE_NUM_ATTEMPTS=5
retry() {
  local attempt
  for ((attempt = 1; attempt < ${AWS_ATTEMPTS:-30}; attempt++)); do
    "$@" && return 0
    sleep "${AWS_RETRY_SECONDS:-6}"
  done
  "$@"
}
config=$(retry aws ssm get-parameter --region "$AWS_REGION" --name "$NODE_CONFIG_PARAMETER" \
  --query Parameter.Value --output text)
while IFS= read -r line; do
  [[ $line =~ ^[A-Z_]+=[A-Za-z0-9._:/@+-]*$ ]] || { echo "$NODE_CONFIG_PARAMETER: not KEY=VALUE: $line" >&2; exit 1; }
done <<< "$config"
printf '%s\n' "$config" >> "$ENV_FILE.new"
# shellcheck source=/dev/null
source "$ENV_FILE.new"
STEP=fetch-bootstrap
retry aws s3 cp --region "$AWS_REGION" --only-show-errors "$BOOTSTRAP_URL" "$SCRIPT.new"
chmod 0755 "$SCRIPT.new"
# Replace only what changed, so a re-run leaves the machine as it was.
for f in "$ENV_FILE" "$SCRIPT"; do
  if cmp -s "$f.new" "$f"; then rm "$f.new"; else mv "$f.new" "$f"; fi
done
STEP=start-bootstrap
shopt -s execfail
exec "$SCRIPT" "$ENV_FILE"
