"""The training daemon: node lifecycle, the round, placement, training, data, checkpoints."""
