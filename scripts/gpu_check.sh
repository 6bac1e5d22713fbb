#!/usr/bin/env bash
# On a machine with a CUDA GPU, every CUDA path of ours, each check run even when one before it
# fails (the exit status says whether any did):
# - the CUDA restore tests (pinned-buffer ring, asynchronous host-to-device copies);
# - FSDP2 on CUDA under NCCL: a staged save from the GPU and a restore into the GPU, bit for bit
#   (scripts/gpu_fsdp_check.py);
# - the CUDA restore benchmark against plain host-to-device copies (docs/results/bench_cuda_restore.json);
# - the save benchmark with the state on the GPU (pinned staging; target: torchrevive blocks
#   <= 0.05 s per GB; docs/results/bench_save_cuda.json).
# - the compiled GPT (examples/gpt/train.py, bf16 through FSDP2's mixed precision, NCCL) with its
#   worker killed and restarted from its node's compile caches (docs/results/gpu_gpt_kill_worker.json).
# Python: $PYTHON, else ${TORCHREVIVE_VENV:-.venv}/bin/python (set up by scripts/setup.sh with a CUDA
# torch build, TORCH_SPEC=torch==2.13.0 from the CUDA index). SIZE_GB and REPEATS set the benchmarks' state size and rounds.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-${TORCHREVIVE_VENV:-.venv}/bin/python}"
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
failed=()
check() {  # check NAME COMMAND...: run it, remember a failure, go on
    local name="$1"; shift
    echo "== $name"
    "$@" || { echo "!! $name failed (exit $?)"; failed+=("$name"); }
}
check "device" "$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
check "CUDA restore tests" "$py" -m pytest -q -p no:cacheprovider tests/test_restore_cuda.py
check "FSDP2 on CUDA/NCCL save and restore" "$py" scripts/gpu_fsdp_check.py
check "CUDA restore benchmark" "$py" scripts/bench_cuda_restore.py --size-gb "${SIZE_GB:-2}" \
    --json docs/results/bench_cuda_restore.json
check "save benchmark on CUDA" "$py" scripts/bench_save.py --size-gb "${SIZE_GB:-2}" --repeats "${REPEATS:-3}" --device cuda \
    --json docs/results/bench_save_cuda.json
check "staged save blocks <= 0.05 s/GB" "$py" -c "import json; r = json.load(open('docs/results/bench_save_cuda.json')); \
s = r['torchrevive_blocking_s_per_gb']; print(f'staged save blocks {s:.3f} s/GB'); assert s <= 0.05, 'over 0.05 s/GB'"
check "compiled GPT on CUDA (bf16, NCCL), its worker killed" "$py" scripts/local_cluster.py --nodes 1 \
    --scenario kill-worker --workload gpt --compile on --compile-cache per-node --json docs/results/gpu_gpt_kill_worker.json
if ((${#failed[@]})); then
    printf 'FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "all CUDA checks passed"
