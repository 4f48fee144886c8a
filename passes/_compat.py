"""Every private torch API the passes use, in one place (the passes import nothing of ``fsdp_compile`` outside
``fsdp_compile.passes``; ``fsdp_compile/_compat.py`` holds the rest). Where these move between torch releases, the fallback belongs here.
"""

from __future__ import annotations

from torch._guards import detect_fake_mode
from torch._ops import OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map_only

__all__ = ["FakeTensor", "FakeTensorMode", "OpOverloadPacket", "detect_fake_mode", "tree_flatten", "tree_map_only",
           "unset_fake_temporarily"]
