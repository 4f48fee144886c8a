"""What keeps ranks in step: the agreement on each graph's collectives, the lockstep check-in, the heartbeat."""
