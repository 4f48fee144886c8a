"""Passes that place the collectives: prefetch all-gathers, launch and wait reduce-scatters, say which
stream runs what, move bucket copies into outlined bodies."""
