#!/usr/bin/env bash
# Set up (if needed) and run the main job: examples/train.py as a 2-node elastic job on this
# machine (configs/local.yaml: two agents on 127.0.0.1, embedded c10d rendezvous, 2 workers each).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/${TORCHREVIVE_VENV:-.venv}/bin:$PATH"
steps=${STEPS:-30}
logs=$(mktemp -d /tmp/torchrevive-demo-XXXXXX)
echo "starting 2 nodes (agents) on 127.0.0.1; logs in $logs"
torchrevive run --config configs/local.yaml --set checkpoint.dir="$logs/checkpoints" examples/train.py --steps "$steps" >"$logs/node0.log" 2>&1 &
node0=$!
torchrevive run --config configs/local.yaml --set checkpoint.dir="$logs/checkpoints" examples/train.py --steps "$steps" >"$logs/node1.log" 2>&1 &
node1=$!
trap 'kill $node0 $node1 2>/dev/null || true' EXIT
status=0
wait $node0 || status=$?
wait $node1 || status=$?
# Rank 0 runs on whichever node the rendezvous made first; show its training lines.
grep -h -E "^(world_size|step)=" "$logs"/node*.log
ls "$logs/checkpoints"
[ $status -eq 0 ] && echo "both nodes finished" || echo "a node failed (exit $status); see $logs"
exit $status
