#!/usr/bin/env bash
# Set everything up, lint, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check spes_node tests
.venv/bin/ruff format --check spes_node tests
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Two workers, each taking whole files (a file's swarm fixtures stay in one process): most swarm tests wait on
# matchmaking and timeouts rather than compute, so two at a time finish the suite in about 70% of the serial time on
# 2 cores. SPES_TEST_WORKERS=0 runs it serially.
exec .venv/bin/python -m pytest -q -n "${SPES_TEST_WORKERS:-2}" --dist loadfile "$@"
