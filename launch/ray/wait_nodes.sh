#!/usr/bin/env bash
# Block until every named node has joined the Ray cluster (with its GPUs), or fail saying which not.
#   launch/ray/wait_nodes.sh HEAD_IP:PORT NODE1,NODE2,... [GPUS_PER_NODE] [TIMEOUT_S]
# Node names are what start_head.sh / start_worker.sh used (short hostnames by default).
set -euo pipefail
CHECKOUT=$(cd "$(dirname "$0")/../.." && pwd)
if [[ $# -lt 2 ]]; then
    echo "usage: $0 HEAD_IP:PORT NODE1,NODE2,... [GPUS_PER_NODE] [TIMEOUT_S]" >&2
    exit 2
fi
# run from a source checkout: its hybridrl; the copy installed with the package: the installed one
[[ -f $CHECKOUT/setup.py ]] && export PYTHONPATH=$CHECKOUT${PYTHONPATH:+:$PYTHONPATH}
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
exec "${PYTHON:-python}" -m hybridrl.launch.ray_node wait --address "$1" --nodes "$2" \
    --gpus-per-node "${3:-0}" --timeout "${4:-300}"
