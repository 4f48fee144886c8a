"""Private torch APIs live in two compat modules: ``fsdp_compile/_compat.py`` and, for the passes (which
import nothing of ``fsdp_compile`` outside ``fsdp_compile.passes``), ``passes/_compat.py``. Every other module of the product reaches
torch through its public API, so that a torch release that moves a private name breaks one file.

Read from the source (imports and attribute chains, not comments): ``torch.ops.*`` (functional
collectives and our own ops) is public; ``torch._dynamo.reset`` has a public name,
``torch.compiler.reset``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fsdp_compile", "passes")
COMPAT = {"fsdp_compile/_compat.py", "passes/_compat.py"}
# Private torch modules (and anything else under ``torch._x.``, or ``torch.utils._x``).
PRIVATE_MODULES = {"_dynamo", "_inductor", "_functorch", "_subclasses", "_guards", "_C", "_logging", "_prims",
                   "_higher_order_ops", "_ops"}


def _private(dotted: str) -> bool:
    """Whether ``dotted`` names a private torch module or something in one: ``torch._dynamo.reset``,
    ``torch.utils._pytree.tree_map``, ``torch._logging`` (``torch._foreach_norm``, an op, is not)."""
    parts = dotted.split(".")
    if parts[0] != "torch" or len(parts) < 2:
        return False
    if parts[1] == "utils":
        return len(parts) > 2 and parts[2].startswith("_")
    return parts[1].startswith("_") and (len(parts) > 2 or parts[1] in PRIVATE_MODULES)


def _dotted(node: ast.AST) -> str | None:
    """``torch.a.b`` for an attribute chain rooted at a name, else ``None``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_uses(source: str) -> list[str]:
    """``line: name`` for each private torch name a module imports or reads."""
    found: dict[int, str] = {}
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            names = [dotted] if dotted else []
        for name in names:
            if _private(name) and len(name) > len(found.get(node.lineno, "")):
                found[node.lineno] = name  # (the longest chain on the line)
    return [f"{line}: {name}" for line, name in sorted(found.items())]


def test_private_torch_only_in_the_compat_modules() -> None:
    offenders = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in COMPAT:
                continue
            uses = private_uses(path.read_text())
            if uses:
                offenders[rel] = uses
    assert not offenders, (
        "private torch APIs outside fsdp_compile/_compat.py and passes/_compat.py (move them there, behind a "
        f"name of ours): {offenders}")


def test_the_check_sees_imports_and_attribute_chains_not_comments() -> None:
    source = (
        "import torch\n"
        "import torch._logging\n"                                   # 2
        "from torch._guards import detect_fake_mode\n"              # 3
        "from torch.utils._pytree import tree_map\n"                # 4
        "x = torch._C.DisableTorchFunctionSubclass()\n"             # 5
        "y = torch.ops._c10d_functional.wait_tensor\n"              # public: torch.ops
        "z = torch.utils.checkpoint.CheckpointPolicy\n"             # public
        "# torch._dynamo.reset() in a comment\n"
        "torch._dynamo.reset()\n"                                   # 9
    )
    lines = [int(use.split(":")[0]) for use in private_uses(source)]
    assert lines == [2, 3, 4, 5, 9], private_uses(source)
