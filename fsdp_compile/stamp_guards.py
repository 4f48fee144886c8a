"""Re-reading, on another block, the guards Dynamo installed while it traced a template block.

Part of NOTE [stamped blocks] (``stamp.py``): a later block may be stamped out of the template's trace
only where every guard whose source runs through the template block holds, with the same answer, on
that block; and the guards, moved onto it, then guard its graph. Here: which guards those are
(:func:`block_guards`), their re-reading and moving (:func:`check_and_move`), and the comparisons per
kind of guard (classes that ``parametrize`` made one per module compare by what they hold). Sources are
re-read as Python expressions with the block in place of the template (compiled once per template), and
never so that a sharded parameter is gathered (``no_eager_reads``): one rank alone runs this.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

from torch import Tensor, nn

__all__ = ["BlockGuard", "Refuse", "block_guards", "check_and_move", "depth_below", "own_tensors", "shown",
           "source_name"]


class Refuse(Exception):
    """A block that cannot be stamped (the reason, for logs)."""


def own_tensors(block: nn.Module) -> dict[int, tuple[tuple[str, ...], str, str]]:
    """Every tensor a block holds, by id: its shards (and flat shards), buffers and parameters, as (path,
    kind, name)."""
    out: dict[int, tuple[tuple[str, ...], str, str]] = {}
    for path, m in block.named_modules():
        parts = tuple(path.split(".")) if path else ()
        for name, sp in getattr(m, "_fsdp_reads", {}).items():
            out.setdefault(id(sp.shard), (parts, "shard", name))
            if sp.flat is not None:  # NOTE [flat shards] in flat.py: what compiled code reads
                out.setdefault(id(sp.flat), (parts, "flat", name))
        for name, t in m._buffers.items():
            if t is not None:
                out.setdefault(id(t), (parts, "buffer", name))
        for name, t in m._parameters.items():
            if t is not None:
                out.setdefault(id(t), (parts, "param", name))
    return out


def depth_below(source: Any, root: Any) -> int | None:
    """How many steps ``source`` is below ``root`` (``None``: not below it)."""
    depth = 0
    while source is not None:
        if source is root or source == root:
            return depth
        source, depth = getattr(source, "base", None), depth + 1
    return None


def _moved(source: Any, depth: int, root: Any, to: Any, memo: dict[int, Any]) -> Any:
    """``source`` with its base ``depth`` steps up (``root``) replaced by ``to``, and so is ``root`` in any
    source it holds besides its base (a dict item's key, read from the block's own dict of hooks, say)."""
    if depth == 0:
        return to
    done = memo.get(id(source))
    if done is None:
        from torch._guards import Source

        changes = {"base": _moved(source.base, depth - 1, root, to, memo)}
        for field in dataclasses.fields(source):
            value = getattr(source, field.name)
            if field.name != "base" and isinstance(value, Source):
                below = depth_below(value, root)
                if below is not None:
                    changes[field.name] = _moved(value, below, root, to, memo)
        done = memo[id(source)] = dataclasses.replace(source, **changes)
    return done


_MISSING = object()
_ROOT = "___fsdp_block"


def source_name(source: Any) -> str:
    """A source's Python expression (a method in some torch versions, a property in others)."""
    name = source.name
    return name() if callable(name) else name


def _scope(tx: Any) -> dict[str, Any]:
    from torch._dynamo.guards import _get_closure_vars

    output = tx.output
    return {"L": output.local_scope, "G": output.global_scope, **_get_closure_vars()}


def _evaluate(code: Any, scope: dict[str, Any], block: nn.Module) -> Any:
    try:
        return eval(code, {**scope, _ROOT: block})  # noqa: S307 (Dynamo's own source expressions)
    except Exception:
        return _MISSING


@dataclasses.dataclass
class BlockGuard:
    """A guard of the template whose source runs through the template block, ready to re-read on another."""

    guard: Any
    kind: str
    depth: int
    code: Any                        # its source's expression, from the block (the block is ``_ROOT``)
    value: Any                       # its value on the template block
    other: Any = None                # DUPLICATE_INPUT: (depth or None, code) of the second source
    fixed: bool = False              # checked on a later block, not moved onto it (NOTE [guards fixed by sharding])


def _relative(source: Any, root_name: str) -> Any:
    name = source_name(source)
    if root_name not in name:
        raise Refuse(f"cannot re-read {name} from another block")
    return compile(name.replace(root_name, _ROOT), "<fsdp_compile.stamp>", "eval")


def block_guards(tx: Any, root: Any, block: nn.Module) -> list[BlockGuard]:
    """The guards of the trace whose source runs through the template block ``block`` (at ``root``)."""
    from .reads import no_eager_reads

    with no_eager_reads():  # (re-reading a source must never gather a parameter: one rank runs this)
        return _read_block_guards(tx, root, block)


def _read_block_guards(tx: Any, root: Any, block: nn.Module) -> list[BlockGuard]:
    scope, root_name = _scope(tx), source_name(root)
    out = []
    for guard in tx.output.guards:
        depth = depth_below(guard.originating_source, root)
        if depth is None:
            continue
        kind = guard.create_fn_name()
        source = guard.originating_source.base if kind == "HASATTR" else guard.originating_source
        code = _relative(source, root_name)
        record = BlockGuard(guard, kind, depth, code, _evaluate(code, scope, block),
                            fixed=_set_by_sharding(guard.originating_source))
        if kind == "DUPLICATE_INPUT":
            other = guard.create_fn.keywords["source_b"]
            other_depth = depth_below(other, root)
            other_code = _relative(other, root_name) if other_depth is not None else None
            record.other = (other_depth, other_code)
        out.append(record)
    return out


# Guards whose check is on the object's identity, on its type, on equality, on None-ness, on length.
_SAME_OBJECT = {"ID_MATCH", "FUNCTION_MATCH", "BUILTIN_MATCH", "MODULE_MATCH", "CLASS_MATCH",
                "NN_MODULE"}
_EQUAL = {"EQUALS_MATCH", "CONSTANT_MATCH", "BOOL_MATCH"}
_TENSOR = {"TENSOR_MATCH", "DISPATCH_KEY_SET_MATCH"}


def _alike_functions(f: Any, g: Any, assumed: set[tuple[int, int]]) -> bool:
    if f is g:
        return True
    if not (callable(f) and callable(g)) or getattr(f, "__code__", None) is not getattr(g, "__code__", _MISSING):
        return False
    cells_f, cells_g = f.__closure__ or (), g.__closure__ or ()
    return len(cells_f) == len(cells_g) and all(_alike_values(x.cell_contents, y.cell_contents, assumed)
                                                for x, y in zip(cells_f, cells_g))


def _alike_values(x: Any, y: Any, assumed: set[tuple[int, int]]) -> bool:
    if x is y:
        return True
    if isinstance(x, type) and isinstance(y, type):
        return _alike_classes(x, y, assumed)
    if isinstance(x, nn.Module) and isinstance(y, nn.Module):  # the module a parametrized class was made for
        return _alike_classes(type(x), type(y), assumed)  # (its state is guarded apart)
    if type(x) is not type(y):
        return False
    if isinstance(x, types.FunctionType):
        return _alike_functions(x, y, assumed)
    if isinstance(x, property):
        return all(_alike_values(getattr(x, f), getattr(y, f), assumed) for f in ("fget", "fset", "fdel"))
    if isinstance(x, (bool, int, float, str, type(None))):
        return x == y
    return False


def _alike_classes(a: type, b: type, assumed: set[tuple[int, int]] | None = None) -> bool:
    """The same class, or two classes made alike for two modules (``parametrize`` makes one class per
    module it parametrizes: same name, alike bases, and the same properties and methods from the same
    code, closing over alike values)."""
    if a is b:
        return True
    assumed = set() if assumed is None else assumed
    if (id(a), id(b)) in assumed:  # (a class's methods may close over the class)
        return True
    assumed.add((id(a), id(b)))
    if a.__name__ != b.__name__ or len(a.__bases__) != len(b.__bases__) or a.__dict__.keys() != b.__dict__.keys():
        return False
    # (a block that holds a sharded parameter itself has parametrize's class for it among its bases)
    if not all(_alike_classes(x, y, assumed) for x, y in zip(a.__bases__, b.__bases__)):
        return False
    skip = ("__doc__", "__module__", "__dict__", "__weakref__", "__qualname__")
    return all(key in skip or _alike_values(x, b.__dict__[key], assumed) for key, x in a.__dict__.items())


def _agree(kind: str, guard: Any, a: Any, b: Any) -> bool:
    """Whether the template's value ``a`` and this block's ``b`` pass the same guard of ``kind``."""
    if a is _MISSING or b is _MISSING:
        return False
    if kind == "TYPE_MATCH":
        return _alike_classes(type(a), type(b))
    if kind in _SAME_OBJECT:
        return a is b
    if kind == "CLOSURE_MATCH":  # (a function's code, as Dynamo checks it; its cells are guarded apart)
        if type(a) is types.FunctionType and type(b) is types.FunctionType:
            return a.__code__ is b.__code__
        return a is b
    if kind in _EQUAL:
        try:
            return type(a) is type(b) and bool(a == b)
        except Exception:
            return False
    if kind in ("NONE_MATCH", "NOT_NONE_MATCH"):
        return (a is None) == (b is None)
    if kind in ("SEQUENCE_LENGTH", "LENGTH_CHECK"):
        return type(a) is type(b) and len(a) == len(b)
    if kind in ("DICT_KEYS_MATCH", "MAPPING_KEYS_CHECK"):
        return type(a) is type(b) and list(a.keys()) == list(b.keys())
    if kind == "EMPTY_NN_MODULE_HOOKS_DICT":
        return len(a) == 0 and len(b) == 0
    if kind in ("DICT_CONTAINS", "DICT_NOT_CONTAINS", "SET_CONTAINS"):
        key = guard.create_fn.keywords.get("key")
        return (key in a) == (key in b)
    if kind == "NOT_PRESENT_IN_GENERIC_DICT":
        attr = guard.create_fn.keywords.get("attr")
        return (attr in getattr(a, "__dict__", {})) == (attr in getattr(b, "__dict__", {}))
    return False


def check_and_move(tx: Any, template: Any, source: Any, block: nn.Module) -> list[Any]:
    """The template's guards moved onto ``block`` (at ``source``), after checking each agrees there."""
    from .reads import no_eager_reads

    with no_eager_reads():  # (as in _block_guards)
        return _checked_and_moved(tx, template, source, block)


def _checked_and_moved(tx: Any, template: Any, source: Any, block: nn.Module) -> list[Any]:
    from torch._guards import Guard

    scope = _scope(tx)
    theirs = own_tensors(block)
    memo: dict[int, Any] = {}
    moved = []
    for record in template.guards:
        guard, kind, a = record.guard, record.kind, record.value
        b = _evaluate(record.code, scope, block)
        if kind in _TENSOR:
            index = template.tensors.get(id(a))
            role = template.roles[index] if index is not None else None
            if role is None or not isinstance(b, Tensor) or theirs.get(id(b)) != role:
                raise Refuse(f"the body reads a tensor of the block that is not one of its own ({kind} on "
                              f"{source_name(guard.originating_source)})")
            if (b.shape, b.stride(), b.dtype, b.device, b.requires_grad) != (
                    a.shape, a.stride(), a.dtype, a.device, a.requires_grad):
                raise Refuse(f"{source_name(guard.originating_source)} differs from the template's")
            continue  # (guarded where the stamped call reads it)
        here = _moved(guard.originating_source, record.depth, template.source, source, memo)
        if kind == "DUPLICATE_INPUT":  # two sources, one object
            other_depth, other_code = record.other
            other = guard.create_fn.keywords["source_b"]
            there = other if other_depth is None else _moved(other, other_depth, template.source, source, memo)
            b_other = _evaluate(other_code, scope, block) if other_code is not None else _evaluate(
                compile(source_name(other), "<fsdp_compile.stamp>", "eval"), scope, block)
            if b is _MISSING or b is not b_other:
                raise Refuse(f"{source_name(here)} is not {source_name(there)}, as in the template")
            if not record.fixed:
                moved.append(_like(guard, Guard(here, functools.partial(guard.create_fn.func, source_b=there))))
            continue
        if kind == "HASATTR":
            member = guard.originating_source.member
            if a is _MISSING or b is _MISSING or hasattr(a, member) != hasattr(b, member):
                raise Refuse(f"{source_name(here)} differs from the template's")
        elif not _agree(kind, guard, a, b):
            raise Refuse(f"{kind} on {source_name(here)} differs from the template's ({shown(b)}, not {shown(a)})")
        if not record.fixed:
            moved.append(_like(guard, Guard(here, guard.create_fn)))
    return moved


# What ``fully_shard`` writes on a ShardedParam for a unit's whole life (``sharding.py``, ``flat.py``).
_SET_BY_SHARDING = frozenset({"flat", "shard", "offset", "piece_shape", "traced_args"})


def _set_by_sharding(source: Any) -> bool:
    """NOTE [guards fixed by sharding]: a template's guard on where a read finds its piece (a
    ShardedParam's flat or shard, the piece's offset and shape, the marker's constant arguments: the
    source ``..._fsdp_reads[name].<field>``) is checked on a later block, but not moved onto it. Those
    fields are written by ``fully_shard`` and by laying a unit's flat out again, for the unit's
    parameters all at once, and the same for every alike block (outlined units' marker arguments leave
    out the unit and the name); a change to them changes the template's too, whose guards stay, or the
    flat tensor the stamped call reads, which its input guards. What stays moved on each block is what
    a user can change on one block alone: the ``_fsdp_reads`` entry itself (a parametrization of one's
    own takes it out), ``accumulating``, the property, hooks, types, attributes. On a Llama block this
    is 54 of the 243 guards, 6 per parameter; Dynamo builds each moved guard for every block."""
    member = getattr(source, "member", None)
    if member not in _SET_BY_SHARDING:
        return False
    item = getattr(source, "base", None)
    reads = getattr(item, "base", None)
    return getattr(reads, "member", None) == "_fsdp_reads"


def shown(value: Any) -> str:
    """A value for a log line: constants as they are, anything else by its type (never the object's own
    ``repr``, which may read a sharded parameter, an eager collective that one rank alone would make)."""
    return repr(value) if isinstance(value, (bool, int, float, str, type(None))) else type(value).__name__


def _like(template: Any, guard: Any) -> Any:
    """``guard`` with the template guard's stacks (where it came from in the user's code)."""
    guard.stack, guard.user_stack = template.stack, template.user_stack
    return guard
