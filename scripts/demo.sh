#!/usr/bin/env bash
# Set everything up, then train a 3-node swarm on this machine (tiny preset, embedded corpus, no downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/spes-node simulate ${NODES:+--nodes "$NODES"} --max-rounds "${ROUNDS:-6}" "$@"
