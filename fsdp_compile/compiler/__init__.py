"""How a graph is compiled: the backend, its options and pass stages, the resharding partition, the naming of
outlined bodies' markers, the warm-start cache, garbage collection while compiling."""
