#!/usr/bin/env bash
# The main job on the emulated local cluster: 2 nodes, numbers data, transformer-tiny across both
# nodes with mpirun, the run fetched into ./runs/, the cluster torn down (also on failure or Ctrl-C).
#   scripts/demo.sh [NODES] [LINK]      e.g. scripts/demo.sh 2 1gbit
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=${1:-2}
LINK=${2:-}
export PATH=$PWD/.venv/bin:$PATH

fab local.up --nodes "$NODES" ${LINK:+--link "$LINK"}
trap 'fab local.down --yes' EXIT  # the demo's run is fetched; on failure or Ctrl-C it goes too
fab status
fab data --dataset numbers
fab train --recipe transformer-tiny --follow
fab fetch
echo "translate with the fetched model:"
echo "four thousand two hundred and seventy-one, twelve" \
  | python -m train.translate runs/transformer-tiny/checkpoints/best.pt \
      --vocabulary runs/transformer-tiny/spm.model
