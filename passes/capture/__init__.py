"""Passes on Dynamo's graph, before AOTAutograd: outline repeated blocks, unroll stacks, hoist and inline
subgraph bodies, group the markers each outlined call reads."""
