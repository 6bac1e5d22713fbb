#!/usr/bin/env bash
# On a machine with a CUDA GPU: the CUDA restore tests (pinned-buffer ring, asynchronous
# host-to-device copies), the CUDA restore benchmark against plain host-to-device copies, and the
# save benchmark with the state on the GPU (pinned staging; target: torchrevive blocking_s <= 0.05
# s per GB). Writes docs/results/bench_cuda_restore.json and bench_save_cuda.json. Run after scripts/setup.sh with a CUDA torch build
# (TORCH_SPEC=torch==2.13.0 from the CUDA index).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${TORCHREVIVE_VENV:-.venv}/bin/python"
"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
"$py" -m pytest -q tests/test_restore_cuda.py
PYTHONPATH="scripts:${PYTHONPATH:-}" "$py" scripts/bench_cuda_restore.py --size-gb "${SIZE_GB:-2}" \
    --json docs/results/bench_cuda_restore.json
PYTHONPATH="scripts:${PYTHONPATH:-}" "$py" scripts/bench_save.py --size-gb "${SIZE_GB:-2}" --device cuda \
    --json docs/results/bench_save_cuda.json
"$py" -c "import json; r = json.load(open('docs/results/bench_save_cuda.json')); \
s = r['torchrevive_blocking_s_per_gb']; print(f'staged save blocks {s:.3f} s/GB'); assert s <= 0.05, 'over 0.05 s/GB'"
