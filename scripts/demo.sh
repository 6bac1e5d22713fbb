#!/usr/bin/env bash
# Set up (if needed) and run the main job: examples/train.py as an elastic job of 3 nodes (3
# agents on 127.0.0.1, embedded c10d rendezvous, 1 worker each, checkpoints every 5 steps); once
# it trains, one node is killed (agent and workers, SIGKILL) and the other two resume at world
# size 2 from the last committed snapshot. Prints the recovery time and its phases, read from
# the job's event log. More: python scripts/local_cluster.py --help (freeze, join, --baseline).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${TORCHREVIVE_VENV:-.venv}/bin/python" scripts/local_cluster.py --nodes 3 --nproc-per-node 1 \
    --scenario kill --state-mb "${STATE_MB:-64}" "$@"
