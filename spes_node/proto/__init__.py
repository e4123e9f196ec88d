"""Protobuf messages of the DHT records (generated from proto/spes.proto by scripts/gen_proto.sh)."""

from spes_node.proto.spes_pb2 import NodeRecord, SwarmConfigRecord

__all__ = ["NodeRecord", "SwarmConfigRecord"]
