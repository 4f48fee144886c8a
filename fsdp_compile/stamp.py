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
it becomes one ``fsdp::stamped`` op that reads the block's own tensors (its shards as the one tuple
``fully_shard`` keeps on the module, ``_readers``) and the call's tensor arguments.
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
graph, so a restarted trace starts afresh. Re-reading and moving the template's guards: ``stamp_guards.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
from typing import Any

import torch
from torch import Tensor, nn

from passes.stamp import STAMP_TEMPLATE

from .stamp_guards import Refuse, block_guards, check_and_move, depth_below, own_tensors, source_name

__all__ = ["STAMP_TEMPLATE", "after_call", "before_call", "flat_tensors", "read_own", "rebuild", "stamp_plan",
           "stamped_call"]

log = logging.getLogger(__name__)


_keys = itertools.count(1)
# Output values of each template of the trace in progress, by key (for the stamped op's fake kernel).
_outputs: dict[int, list[Any]] = {}


@torch.library.custom_op("fsdp::stamped", mutates_args=())
def stamped_call(key: int, args: list[Tensor], own: list[Tensor], places: list[int]) -> list[Tensor]:
    """A stamped block's call (NOTE [stamped blocks]): only ever traced, and replaced before AOTAutograd."""
    raise RuntimeError("fsdp::stamped ran: a stamped block's call reached a backend other than fsdp_backend "
                       "(passes/stamp.py replaces it). Compile with fsdp_compile's backend, or shard the blocks "
                       "with fully_shard(..., outline=False).")


@stamped_call.register_fake
def _(key: int, args: list[Tensor], own: list[Tensor], places: list[int]) -> list[Tensor]:
    return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in _outputs[key]]


# ---------------------------------------------------------------------------------------------
# State of one trace
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Template:
    key: int
    source: Any                      # Dynamo's source of the template block
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
            raise Refuse("a tensor argument that is no plain tensor")
        if not all(isinstance(s, int) for s in (*value.shape, *value.stride())):
            raise Refuse("symbolic shapes")
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
    raise Refuse(f"an argument of kind {type(vt).__name__}")


def _positional(signature: Any) -> bool:
    """Whether a call's tensors are its positional arguments, all of them, in order, and nothing else (a
    block's usual call: ``layer(x, cos, sin)``): its traced code then hands the op ``list(args)`` rather
    than walking the arguments (``flat_tensors``, a few calls Dynamo traces per block)."""
    (_, items), kwargs = signature[1]
    return kwargs == ("D", ()) and all(item[0] == "T" for item in items)


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

def _readers(block: nn.Module, roles: tuple[tuple[tuple[str, ...], str, str], ...]) -> tuple[Any, Any]:
    """How a stamped call of ``block`` reads the tensors of ``roles``: ``(places, others)``. The call hands
    its op the block's ``_fsdp_shards`` followed by the ``others`` roles read one by one; ``places[j]`` is
    where role ``j`` is in that list. Reaching a shard through its submodule, the module's dict of reads
    and the read costs Dynamo a variable and guards each step: a third of a stamped block's trace;
    the tuple is one attribute. Reading a shard there is reading it by role: the tuple holds the unit's
    ShardedParams' shards, fixed for the unit's life, and the moved guards hold the role's path and
    its ``_fsdp_reads`` entry the same as the template's."""
    shards = block._fsdp_shards  # (every unit's module has it: fully_shard)
    at = {id(t): i for i, t in enumerate(shards)}
    places: list[int] = []
    others: list[Any] = []
    for role in roles:
        parts, kind, name = role
        place = None
        if kind in ("shard", "flat"):
            m = block
            for part in parts:
                m = getattr(m, part)
            sp = m._fsdp_reads[name]
            place = at.get(id(sp.flat if kind == "flat" else sp.shard))
        if place is None:
            place = len(shards) + len(others)
            others.append(role)
        places.append(place)
    return tuple(places), tuple(others)


def read_own(block: nn.Module, roles: tuple[tuple[tuple[str, ...], str, str], ...]) -> list[Tensor]:
    """The block's tensors of ``roles`` (traced by Dynamo for a stamped call)."""
    out = []
    for parts, kind, name in roles:
        m = block
        for part in parts:
            m = getattr(m, part)
        if kind == "shard":
            out.append(m._fsdp_reads[name].shard)
        elif kind == "flat":
            out.append(m._fsdp_reads[name].flat)
        elif kind == "buffer":
            out.append(m._buffers[name])
        else:
            out.append(m._parameters[name])
    return out


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
        except Refuse as why:
            log.debug("%s traced, not stamped: %s", source_name(source), why)
            return
        template = state.templates.get(signature)
        if template is None:
            if signature not in state.templates:
                state.pending = (signature, source, block, proxies)
            return
        try:
            guards = check_and_move(tx, template, source, block)
        except Refuse as why:
            log.debug("%s traced, not stamped: %s", source_name(source), why)
            return
        for guard in guards:  # (their stacks are the template's: no new ones collected)
            tx.output.guards.add(guard, collect_debug_stack=False)
        state.plan = (template.key, _positional(signature), *_readers(block, template.roles), template.out_spec)

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
    raise Refuse(f"a result of kind {type(vt).__name__}")


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
            raise Refuse("the result is not one call's outputs")
        (call,) = calls
        if call.target is not torch.ops.higher_order.invoke_subgraph:
            raise Refuse("the call is no invoke_subgraph")
        plan, roles, tensors = _operand_plan(call, [p.node for p in arg_proxies], source, block)
    except Refuse as why:
        log.debug("%s is no template: %s", source_name(source), why)
        return
    try:
        guards = block_guards(tx, source, block)
    except Refuse as why:
        log.debug("%s is no template: %s", source_name(source), why)
        return
    key = next(_keys)
    _outputs[key] = [n.meta["example_value"] for n in nodes]
    call.meta[STAMP_TEMPLATE] = (key, tuple(plan), tuple(n.args[1] for n in nodes))
    state.templates[signature] = _Template(key, source, guards, roles, tensors, spec)


def _operand_plan(call: Any, args: list[Any], source: Any, block: nn.Module) -> tuple[list[Any], Any, Any]:
    """For each operand of the template's call: ("arg", i), ("own", j) or ("same",)."""
    own = own_tensors(block)
    roles: list[tuple[tuple[str, ...], str, str]] = []
    tensors: dict[int, int] = {}
    plan: list[Any] = []
    for operand in call.args[2:]:
        if not isinstance(operand, torch.fx.Node):
            raise Refuse("a constant operand")
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
        elif operand_source is not None and depth_below(operand_source, source) is not None:
            raise Refuse(f"the body reads {source_name(operand_source)}, which is not one of the block's own tensors")
        elif operand.op == "placeholder" or operand.op == "get_attr":
            plan.append(("same",))
        else:
            raise Refuse("an operand computed in the graph that is no argument of the call")
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

