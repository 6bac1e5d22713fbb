#!/usr/bin/env bash
# Create ./.venv-peers with the tools the benchmarks measure torchrevive beside: torchft (its
# Lighthouse and Manager) and NVIDIA's nvidia-resiliency-ext (ft_launcher). A separate virtual
# environment: the peers are never dependencies of torchrevive. Idempotent; prints the python path.
# TORCH_SPEC picks the torch build, as in scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${TORCHREVIVE_PEERS_VENV:-.venv-peers}
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
stamp="$venv/.torchrevive-peers"
want=$(sha256sum <scripts/setup_peers.sh | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}" numpy >&2
  "$venv/bin/python" -m pip install -q torchft==0.2.0 nvidia-resiliency-ext==0.4.1 >&2
  echo "$want" >"$stamp"
fi
echo "$PWD/$venv/bin/python"
