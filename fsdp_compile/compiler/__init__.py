"""How a graph is compiled: the backend, the resharding partition, outlined bodies before AOTAutograd, the warm-start cache, garbage collection while compiling."""
