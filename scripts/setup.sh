#!/usr/bin/env bash
# Create .venv in the repository and install spes-node with its test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# A CPU build of torch is enough for the demo and the tests; a GPU machine may install any CUDA build first.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet -e ".[test]"
