#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite; extra arguments go to pytest.
# --quick (first): leave out the tests marked slow (multi-agent jobs, soaks, benchmarks; tests/conftest.py's SLOW).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=()
if [ "${1:-}" = "--quick" ]; then
  quick=(-m "not slow")
  shift
fi
bash scripts/setup.sh
exec "${TORCHREVIVE_VENV:-.venv}/bin/python" -m pytest -q "${quick[@]}" "$@"
