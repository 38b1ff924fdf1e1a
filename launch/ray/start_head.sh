#!/usr/bin/env bash
# Start the Ray head of a multi-node hybridrl cluster on this machine (no Slurm), in the foreground:
# Ctrl-C / SIGTERM stops exactly this node's Ray processes. Then start_worker.sh on every other node,
# wait_nodes.sh, and run the trainer with RAY_ADDRESS set (launch/README.md).
#   launch/ray/start_head.sh [extra `ray_node start` options, e.g. --num-gpus 8 --num-cpus 64]
# Environment: HYBRIDRL_RAY_PORT_BASE (20000; the GCS port; 400 ports from it are used),
#   HYBRIDRL_IP_MODE (auto | iface:NAME | an IPv4 address | loopback for a one-host test),
#   HYBRIDRL_NODE_NAME (short hostname), HYBRIDRL_RAY_TMP (node-local, short), PYTHON (python).
set -euo pipefail
CHECKOUT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-python}
PORT_BASE=${HYBRIDRL_RAY_PORT_BASE:-20000}
IP_MODE=${HYBRIDRL_IP_MODE:-auto}
NODE_NAME=${HYBRIDRL_NODE_NAME:-$(hostname -s)}
RAY_TMP=${HYBRIDRL_RAY_TMP:-/tmp/hr-ray-$(id -un)-$PORT_BASE}
# run from a source checkout: its hybridrl; the copy installed with the package: the installed one
[[ -f $CHECKOUT/setup.py ]] && export PYTHONPATH=$CHECKOUT${PYTHONPATH:+:$PYTHONPATH}
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

IP=$("$PYTHON" -m hybridrl.launch.ray_node ip --ip-mode "$IP_MODE" --node-index 0)
echo "Ray head $NODE_NAME at $IP:$PORT_BASE. On every other node run:" >&2
echo "  HYBRIDRL_IP_MODE=$IP_MODE launch/ray/start_worker.sh $IP:$PORT_BASE" >&2
echo "and for the driver: export RAY_ADDRESS=$IP:$PORT_BASE RAY_AUTH_MODE=$RAY_AUTH_MODE" >&2
exec "$PYTHON" -m hybridrl.launch.ray_node start --role head --node-name "$NODE_NAME" --node-index 0 \
    --ip-mode "$IP_MODE" --port-base "$PORT_BASE" --temp-dir "$RAY_TMP/n0" "$@"
