"""The demo, its Llama-style model and the rank launcher the demo, tests and benchmarks use."""
