"""The swarm plumbing: DHT records, identities and keys, state transfer, averaging, relays."""
