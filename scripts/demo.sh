#!/usr/bin/env bash
# Set up (if needed) and run the main job: examples/train.py as a 2-node elastic job on this
# machine (configs/local.yaml: two agents on 127.0.0.1, embedded c10d rendezvous, 2 workers each).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/${TORCHREVIVE_VENV:-.venv}/bin:$PATH"
steps=${STEPS:-30}
torchrevive run --config configs/local.yaml examples/train.py --steps "$steps" >/tmp/torchrevive-demo-node1.log 2>&1 &
node1=$!
trap 'kill $node1 2>/dev/null || true' EXIT
torchrevive run --config configs/local.yaml examples/train.py --steps "$steps"
wait $node1
echo "both nodes finished; node 1's log: /tmp/torchrevive-demo-node1.log"
