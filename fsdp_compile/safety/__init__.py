"""What keeps ranks in step: the cross-rank agreement on each graph's collectives, the lockstep check-in, the peers' heartbeat."""
