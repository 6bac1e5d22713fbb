#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${TORCHREVIVE_VENV:-.venv}/bin/python" -m pytest -q "$@"
