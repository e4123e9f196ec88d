#!/usr/bin/env bash
# Regenerates spes_node/proto/*_pb2.py from proto/*.proto (needs grpcio-tools).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc --proto_path=proto --python_out=spes_node/proto proto/*.proto
