"""An empty module: its name lets ``TORCH_LOGS=fsdp_schedule`` pass torch's check at import.

Torch checks ``TORCH_LOGS`` when it is imported, before ``fsdp_compile`` can register its
``fsdp_schedule`` artifact, and accepts a name that is a registered artifact *or a module that can be
found*. This module is that name and nothing else: it runs no code, and torch only finds it, never
imports it. ``import fsdp_compile`` registers the artifact and switches it on when ``TORCH_LOGS`` names
it (``fsdp_compile/inspection/logs.py``).
"""
