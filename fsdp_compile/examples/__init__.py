"""What the command line runs, and what it runs on: the demo, ``explain``, the Llama-style model and its
presets, the rank launcher the demo, tests and benchmarks use. Nothing in the library imports this
package; only ``__main__.py`` does (tests/test_layers.py)."""
