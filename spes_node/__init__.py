"""spes-node: SParse Expert Synchronization over a hivemind swarm."""

__version__ = "0.1.0"
