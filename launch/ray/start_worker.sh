#!/usr/bin/env bash
# Join this machine to a hybridrl Ray cluster (no Slurm), in the foreground; Ctrl-C / SIGTERM stops
# exactly this node's Ray processes.
#   launch/ray/start_worker.sh HEAD_IP:PORT [extra `ray_node start` options, e.g. --num-gpus 8]
# Waits up to HYBRIDRL_HEAD_TIMEOUT (300) s for the head. Environment as for start_head.sh, plus
# HYBRIDRL_NODE_INDEX (1; only matters with HYBRIDRL_IP_MODE=loopback: node k gets 127.0.0.<k+2>).
set -euo pipefail
CHECKOUT=$(cd "$(dirname "$0")/../.." && pwd)
if [[ $# -lt 1 || $1 != *:* ]]; then
    echo "usage: $0 HEAD_IP:PORT [ray_node start options]  (start_head.sh prints the address)" >&2
    exit 2
fi
HEAD_ADDRESS=$1
shift
PYTHON=${PYTHON:-python}
PORT_BASE=${HEAD_ADDRESS##*:}   # every node uses the same port block as the head
IP_MODE=${HYBRIDRL_IP_MODE:-auto}
NODE_INDEX=${HYBRIDRL_NODE_INDEX:-1}
NODE_NAME=${HYBRIDRL_NODE_NAME:-$(hostname -s)}
RAY_TMP=${HYBRIDRL_RAY_TMP:-/tmp/hr-ray-$(id -un)-$PORT_BASE}
# run from a source checkout: its hybridrl; the copy installed with the package: the installed one
[[ -f $CHECKOUT/setup.py ]] && export PYTHONPATH=$CHECKOUT${PYTHONPATH:+:$PYTHONPATH}
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

exec "$PYTHON" -m hybridrl.launch.ray_node start --role worker --head-address "$HEAD_ADDRESS" \
    --head-timeout "${HYBRIDRL_HEAD_TIMEOUT:-300}" --node-name "$NODE_NAME" --node-index "$NODE_INDEX" \
    --ip-mode "$IP_MODE" --port-base "$PORT_BASE" --temp-dir "$RAY_TMP/n$NODE_INDEX" "$@"
