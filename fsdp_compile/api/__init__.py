"""What the user calls: groups, fully_shard and its units, reading and initialising sharded parameters, gradients, accumulation, checkpoints, stacked blocks."""
