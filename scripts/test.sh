#!/usr/bin/env bash
# Set everything up, lint, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check spes_node tests
.venv/bin/ruff format --check spes_node tests
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -q "$@"
