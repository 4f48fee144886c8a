"""Stamped blocks: Dynamo traces an outlined block's region once, and stamps it out for every alike block.

NOTE [stamped blocks]: an outlined model (NOTE [outlined units] in ``module.py``) hands Dynamo one call of
the block's region per block. Torch 2.13's Dynamo traces the region once and checks each later call's
guards against the first trace; torch 2.11's (the GPUs' torch) traces every call again and only then
finds the bodies equal: the part of a cold compile that grows fastest with depth there (README, Compile
time). This module does, for our backend's traces, what 2.13 does: the first call of a region is traced
(the *template*); for each later call, the guards Dynamo installed on the template block (every one whose
source runs through the block: its attributes, submodule types, ``training`` flags, hooks dicts, the
markers' arguments) are re-read on this block, and when all agree, and the call's arguments agree with
the template's (the same constants, tensors of the same shape, strides, dtype, device and
``requires_grad``, aliased alike, under the same grad mode and context managers), the call is not traced:
it becomes one ``fsdp::stamped`` op that reads the block's own tensors and the call's tensor arguments.
The same guards, moved onto this block, join the graph's guards, so a later change to one block (its
``eval()``, an attribute its forward reads) recompiles, exactly as if the block had been traced. Before
AOTAutograd, ``passes/stamp.py`` turns each stamped op into a call of the template's body with the block's
own tensors in the template's places: the graph a traced call would have given.

A call is traced instead (and is then a template of its own where it can be) whenever anything is not
known to agree: a guard of a kind we do not re-check, a block tensor the body reads that is not one of
its shards, buffers or parameters, a non-constant argument, symbolic shapes, a call inside another
higher-order op's body. What this cannot see is state a block's forward reaches other than through the
block or its arguments (a global table keyed by the block object, say): the template's guards on it
hold for the template only. Such a block must be sharded with ``fully_shard(..., outline=False)``.

The decisions run inside Dynamo's trace (``comptime``, with Dynamo's variables and guards at hand) and
reach the traced code as constants (``assume_constant_result``); their state lives on the trace's output
graph, so a restarted trace starts afresh.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import operator
import types
from typing import Any

import torch
from torch import Tensor, nn

from passes.stamp import STAMP_TEMPLATE

__all__ = ["STAMP_TEMPLATE", "after_call", "before_call", "flat_tensors", "read_own", "rebuild", "stamp_plan",
           "stamped_call"]

log = logging.getLogger(__name__)


_keys = itertools.count(1)
# Output values of each template of the trace in progress, by key (for the stamped op's fake kernel).
_outputs: dict[int, list[Any]] = {}


@torch.library.custom_op("fsdp::stamped", mutates_args=())
def stamped_call(key: int, args: list[Tensor], own: list[Tensor]) -> list[Tensor]:
    """A stamped block's call (NOTE [stamped blocks]): only ever traced, and replaced before AOTAutograd."""
    raise RuntimeError("fsdp::stamped ran: a stamped block's call reached a backend other than fsdp_backend "
                       "(passes/stamp.py replaces it). Compile with fsdp_compile's backend, or shard the blocks "
                       "with fully_shard(..., outline=False).")


@stamped_call.register_fake
def _(key: int, args: list[Tensor], own: list[Tensor]) -> list[Tensor]:
    return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in _outputs[key]]


# ---------------------------------------------------------------------------------------------
# State of one trace
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Template:
    key: int
    source: Any                      # Dynamo's source of the template block
    block: nn.Module
    guards: list[Any]                # guards whose source runs through the block
    roles: tuple[tuple[tuple[str, ...], str, str], ...]  # (submodule path, kind, name) of each own tensor the body reads
    tensors: dict[int, int]          # id(template block's tensor) -> index in roles
    out_spec: Any


@dataclasses.dataclass
class _State:
    templates: dict[Any, _Template | None] = dataclasses.field(default_factory=dict)
    pending: Any = None              # (signature, source, block, arg proxies) of the call being traced
    plan: Any = None                 # the decision for the current call, read by stamp_plan()


def _state(tx: Any) -> _State:
    output = tx.output
    state = getattr(output, "_fsdp_stamps", None)
    if state is None:
        state = _State()
        output._fsdp_stamps = state
        _outputs.clear()  # (a finished trace's stamped ops never run their fake kernel again)
    return state


class _Refuse(Exception):
    """This call cannot be stamped (the reason, for logs)."""


def _current_tx() -> Any:
    from torch._dynamo.symbolic_convert import InstructionTranslator

    return InstructionTranslator.current_tx()


@torch._dynamo.assume_constant_result
def stamp_plan() -> Any:
    """The decision ``before_call`` took for the call being traced: ``None`` (trace it), or ``(key, roles,
    out_spec)`` (stamp it)."""
    state = _state(_current_tx())
    plan, state.plan = state.plan, None
    return plan


# ---------------------------------------------------------------------------------------------
# Call signatures
# ---------------------------------------------------------------------------------------------

def _vt(ctx: Any, name: str) -> Any:
    return ctx.get_local(name)._i_will_not_complain_if_bc_breaks_VariableTracker()


def _leaves(vt: Any, proxies: list[Any]) -> Any:
    """A hashable description of an argument's variable; its tensors' proxies appended to ``proxies``."""
    from torch._dynamo import variables as V

    if isinstance(vt, V.TensorVariable):
        value = vt.as_proxy().node.meta.get("example_value")
        if type(value) is not torch._subclasses.fake_tensor.FakeTensor:
            raise _Refuse("a tensor argument that is no plain tensor")
        if not all(isinstance(s, int) for s in (*value.shape, *value.stride())):
            raise _Refuse("symbolic shapes")
        proxies.append(vt.as_proxy())
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad)
    if isinstance(vt, (V.TupleVariable, V.ListVariable)):
        return (type(vt).__name__, tuple(_leaves(v, proxies) for v in vt.items))
    if isinstance(vt, V.ConstDictVariable):
        out = []
        for k, v in vt.items.items():
            out.append((k.vt.as_python_constant(), _leaves(v, proxies)))
        return ("D", tuple(out))
    if vt.is_python_constant():
        value = vt.as_python_constant()
        if isinstance(value, (bool, int, float, str, type(None), torch.dtype, torch.device)):
            return ("C", type(value), value)
    raise _Refuse(f"an argument of kind {type(vt).__name__}")


def _contexts(tx: Any) -> tuple[Any, ...]:
    """The context managers active around the call (grad mode, autocast, ...), as constants."""
    out = []
    while tx is not None:
        for block in getattr(tx, "block_stack", ()):
            ctx = getattr(block, "with_context", None)
            out.append((type(ctx).__name__, repr(getattr(ctx, "target_values", None))))
        tx = getattr(tx, "parent", None)
    return tuple(out)


def _signature(ctx: Any, tx: Any, forward: Any) -> tuple[Any, list[Any]]:
    proxies: list[Any] = []
    described = (_leaves(_vt(ctx, "args"), proxies), _leaves(_vt(ctx, "kwargs"), proxies))
    nodes = [p.node for p in proxies]
    aliasing = tuple(nodes.index(n) for n in nodes)
    return (forward, described, aliasing, torch.is_grad_enabled(), _contexts(tx)), proxies


# ---------------------------------------------------------------------------------------------
# A block's own tensors
# ---------------------------------------------------------------------------------------------

def _own_tensors(block: nn.Module) -> dict[int, tuple[tuple[str, ...], str, str]]:
    """Every tensor a block holds, by id: its shards, buffers and parameters, as (path, kind, name)."""
    out: dict[int, tuple[tuple[str, ...], str, str]] = {}
    for path, m in block.named_modules():
        parts = tuple(path.split(".")) if path else ()
        for name, sp in getattr(m, "_fsdp_reads", {}).items():
            out.setdefault(id(sp.shard), (parts, "shard", name))
        for name, t in m._buffers.items():
            if t is not None:
                out.setdefault(id(t), (parts, "buffer", name))
        for name, t in m._parameters.items():
            if t is not None:
                out.setdefault(id(t), (parts, "param", name))
    return out


def read_own(block: nn.Module, roles: tuple[tuple[tuple[str, ...], str, str], ...]) -> list[Tensor]:
    """The block's tensors of ``roles`` (traced by Dynamo for a stamped call)."""
    out = []
    for parts, kind, name in roles:
        m = block
        for part in parts:
            m = getattr(m, part)
        if kind == "shard":
            out.append(m._fsdp_reads[name].shard)
        elif kind == "buffer":
            out.append(m._buffers[name])
        else:
            out.append(m._parameters[name])
    return out


# ---------------------------------------------------------------------------------------------
# Guards
# ---------------------------------------------------------------------------------------------

def _depth(source: Any, root: Any) -> int | None:
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
                below = _depth(value, root)
                if below is not None:
                    changes[field.name] = _moved(value, below, root, to, memo)
        done = memo[id(source)] = dataclasses.replace(source, **changes)
    return done


_MISSING = object()
_ROOT = "___fsdp_block"


def _name(source: Any) -> str:
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
class _BlockGuard:
    """A guard of the template whose source runs through the template block, ready to re-read on another."""

    guard: Any
    kind: str
    depth: int
    code: Any                        # its source's expression, from the block (the block is ``_ROOT``)
    value: Any                       # its value on the template block
    other: Any = None                # DUPLICATE_INPUT: (depth or None, code, value) of the second source


def _relative(source: Any, root_name: str) -> Any:
    name = _name(source)
    if root_name not in name:
        raise _Refuse(f"cannot re-read {name} from another block")
    return compile(name.replace(root_name, _ROOT), "<fsdp_compile.stamp>", "eval")


def _block_guards(tx: Any, root: Any, block: nn.Module) -> list[_BlockGuard]:
    """The guards of the trace whose source runs through the template block ``block`` (at ``root``)."""
    from .sharding import no_eager_reads

    with no_eager_reads():  # (re-reading a source must never gather a parameter: one rank runs this)
        return _read_block_guards(tx, root, block)


def _read_block_guards(tx: Any, root: Any, block: nn.Module) -> list[_BlockGuard]:
    scope, root_name = _scope(tx), _name(root)
    out = []
    for guard in tx.output.guards:
        depth = _depth(guard.originating_source, root)
        if depth is None:
            continue
        kind = guard.create_fn_name()
        source = guard.originating_source.base if kind == "HASATTR" else guard.originating_source
        code = _relative(source, root_name)
        record = _BlockGuard(guard, kind, depth, code, _evaluate(code, scope, block))
        if kind == "DUPLICATE_INPUT":
            other = guard.create_fn.keywords["source_b"]
            other_depth = _depth(other, root)
            other_code = _relative(other, root_name) if other_depth is not None else None
            other_value = _evaluate(other_code, scope, block) if other_code is not None else None
            record.other = (other_depth, other_code, other_value)
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
    module it parametrizes: same name and bases, and the same properties and methods from the same code,
    closing over alike values)."""
    if a is b:
        return True
    assumed = set() if assumed is None else assumed
    if (id(a), id(b)) in assumed:  # (a class's methods may close over the class)
        return True
    assumed.add((id(a), id(b)))
    if a.__name__ != b.__name__ or a.__bases__ != b.__bases__ or a.__dict__.keys() != b.__dict__.keys():
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


def _check_and_move(tx: Any, template: _Template, source: Any, block: nn.Module) -> list[Any]:
    """The template's guards moved onto ``block`` (at ``source``), after checking each agrees there."""
    from .sharding import no_eager_reads

    with no_eager_reads():  # (as in _block_guards)
        return _checked_and_moved(tx, template, source, block)


def _checked_and_moved(tx: Any, template: _Template, source: Any, block: nn.Module) -> list[Any]:
    from torch._guards import Guard

    scope = _scope(tx)
    theirs = _own_tensors(block)
    memo: dict[int, Any] = {}
    moved = []
    for record in template.guards:
        guard, kind, a = record.guard, record.kind, record.value
        b = _evaluate(record.code, scope, block)
        if kind in _TENSOR:
            index = template.tensors.get(id(a))
            role = template.roles[index] if index is not None else None
            if role is None or not isinstance(b, Tensor) or theirs.get(id(b)) != role:
                raise _Refuse(f"the body reads a tensor of the block that is not one of its own ({kind} on "
                              f"{_name(guard.originating_source)})")
            if (b.shape, b.stride(), b.dtype, b.device, b.requires_grad) != (
                    a.shape, a.stride(), a.dtype, a.device, a.requires_grad):
                raise _Refuse(f"{_name(guard.originating_source)} differs from the template's")
            continue  # (guarded where the stamped call reads it)
        here = _moved(guard.originating_source, record.depth, template.source, source, memo)
        if kind == "DUPLICATE_INPUT":  # two sources, one object
            other_depth, other_code, _ = record.other
            other = guard.create_fn.keywords["source_b"]
            there = other if other_depth is None else _moved(other, other_depth, template.source, source, memo)
            b_other = _evaluate(other_code, scope, block) if other_code is not None else _evaluate(
                compile(_name(other), "<fsdp_compile.stamp>", "eval"), scope, block)
            if b is _MISSING or b is not b_other:
                raise _Refuse(f"{_name(here)} is not {_name(there)}, as in the template")
            moved.append(_like(guard, Guard(here, functools.partial(guard.create_fn.func, source_b=there))))
            continue
        if kind == "HASATTR":
            member = guard.originating_source.member
            if a is _MISSING or b is _MISSING or hasattr(a, member) != hasattr(b, member):
                raise _Refuse(f"{_name(here)} differs from the template's")
        elif not _agree(kind, guard, a, b):
            raise _Refuse(f"{kind} on {_name(here)} differs from the template's ({_shown(b)}, not {_shown(a)})")
        moved.append(_like(guard, Guard(here, guard.create_fn)))
    return moved


def _shown(value: Any) -> str:
    """A value for a log line: constants as they are, anything else by its type (never the object's own
    ``repr``, which may read a sharded parameter, an eager collective that one rank alone would make)."""
    return repr(value) if isinstance(value, (bool, int, float, str, type(None))) else type(value).__name__


def _like(template: Any, guard: Any) -> Any:
    """``guard`` with the template guard's stacks (where it came from in the user's code)."""
    guard.stack, guard.user_stack = template.stack, template.user_stack
    return guard


# ---------------------------------------------------------------------------------------------
# The two comptime hooks around an outlined call
# ---------------------------------------------------------------------------------------------

def before_call(forward: Any) -> Any:
    """A ``comptime`` function for the start of an outlined call of ``forward``: decide whether it is
    stamped (and install its guards) or traced (and remember what a template needs)."""

    def hook(ctx: Any) -> None:
        tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
        state = _state(tx)
        state.plan, state.pending = None, None
        self_vt = _vt(ctx, "self")
        block = self_vt.value if hasattr(self_vt, "value") else None
        source = getattr(self_vt, "source", None)
        if not isinstance(block, nn.Module) or source is None:
            return
        if len(tx.output.tracers) != 1:  # inside another higher-order op's body (activation checkpointing):
            return                       # passes/stamp.py rewrites the outer graph only
        try:
            signature, proxies = _signature(ctx, tx, forward)
        except _Refuse as why:
            log.debug("%s traced, not stamped: %s", _name(source), why)
            return
        template = state.templates.get(signature)
        if template is None:
            if signature not in state.templates:
                state.pending = (signature, source, block, proxies)
            return
        try:
            guards = _check_and_move(tx, template, source, block)
        except _Refuse as why:
            log.debug("%s traced, not stamped: %s", _name(source), why)
            return
        for guard in guards:  # (their stacks are the template's: no new ones collected)
            tx.output.guards.add(guard, collect_debug_stack=False)
        state.plan = (template.key, template.roles, template.out_spec)

    return hook


def _out_spec(vt: Any, outputs: list[Any]) -> Any:
    """How an outlined call's result is built from its flat tensor outputs (each appended as its proxy)."""
    from torch._dynamo import variables as V

    if isinstance(vt, V.TensorVariable):
        outputs.append(vt.as_proxy())
        return ("T", len(outputs) - 1)
    if isinstance(vt, (V.TupleVariable, V.ListVariable)):
        return (type(vt).__name__, tuple(_out_spec(v, outputs) for v in vt.items))
    if vt.is_python_constant():
        value = vt.as_python_constant()
        if isinstance(value, (bool, int, float, str, type(None))):
            return ("C", value)
    raise _Refuse(f"a result of kind {type(vt).__name__}")


def after_call(ctx: Any) -> None:
    """A ``comptime`` function for the end of a traced outlined call: make it a template if it can be."""
    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    state = _state(tx)
    pending, state.pending = state.pending, None
    if pending is None:
        return
    signature, source, block, arg_proxies = pending
    state.templates[signature] = None  # (until it is known to be one)
    try:
        proxies: list[Any] = []
        spec = _out_spec(_vt(ctx, "out"), proxies)
        nodes = [p.node for p in proxies]
        calls = {n.args[0] for n in nodes if n.op == "call_function" and n.args}
        if len(calls) != 1 or any(n.target is not _getitem for n in nodes):
            raise _Refuse("the result is not one call's outputs")
        (call,) = calls
        if call.target is not torch.ops.higher_order.invoke_subgraph:
            raise _Refuse("the call is no invoke_subgraph")
        plan, roles, tensors = _operand_plan(call, [p.node for p in arg_proxies], source, block)
    except _Refuse as why:
        log.debug("%s is no template: %s", _name(source), why)
        return
    try:
        guards = _block_guards(tx, source, block)
    except _Refuse as why:
        log.debug("%s is no template: %s", _name(source), why)
        return
    key = next(_keys)
    _outputs[key] = [n.meta["example_value"] for n in nodes]
    call.meta[STAMP_TEMPLATE] = (key, tuple(plan), tuple(n.args[1] for n in nodes))
    state.templates[signature] = _Template(key, source, block, guards, roles, tensors, spec)


def _operand_plan(call: Any, args: list[Any], source: Any, block: nn.Module) -> tuple[list[Any], Any, Any]:
    """For each operand of the template's call: ("arg", i), ("own", j) or ("same",)."""
    own = _own_tensors(block)
    roles: list[tuple[tuple[str, ...], str, str]] = []
    tensors: dict[int, int] = {}
    plan: list[Any] = []
    for operand in call.args[2:]:
        if not isinstance(operand, torch.fx.Node):
            raise _Refuse("a constant operand")
        if operand in args:
            plan.append(("arg", args.index(operand)))
            continue
        grapharg = operand.meta.get("grapharg") if operand.op == "placeholder" else None
        example = getattr(grapharg, "example", None) if grapharg is not None else None
        operand_source = getattr(grapharg, "source", None) if grapharg is not None else None
        if isinstance(example, Tensor) and id(example) in own:
            if id(example) not in tensors:
                tensors[id(example)] = len(roles)
                roles.append(own[id(example)])
            plan.append(("own", tensors[id(example)]))
        elif operand_source is not None and _depth(operand_source, source) is not None:
            raise _Refuse(f"the body reads {_name(operand_source)}, which is not one of the block's own tensors")
        elif operand.op == "placeholder" or operand.op == "get_attr":
            plan.append(("same",))
        else:
            raise _Refuse("an operand computed in the graph that is no argument of the call")
    return plan, tuple(roles), tensors


_getitem = operator.getitem


def rebuild(spec: Any, flat: list[Tensor]) -> Any:
    """The call's result from the stamped op's outputs (traced by Dynamo)."""
    kind = spec[0]
    if kind == "T":
        return flat[spec[1]]
    if kind == "C":
        return spec[1]
    items = [rebuild(s, flat) for s in spec[1]]
    return tuple(items) if kind == "TupleVariable" else items


def flat_tensors(value: Any, out: list[Tensor]) -> list[Tensor]:
    """The tensors of a call's arguments in the order ``_leaves`` lists them (traced by Dynamo)."""
    if isinstance(value, Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            flat_tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            flat_tensors(v, out)
    return out

