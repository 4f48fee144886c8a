"""Write a rewrite as eager code and splice its trace (``make_fx`` on the inputs' fake values, in the graph's
fake mode) into a graph; every new node carries a fake ``meta["val"]``."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from ._compat import FakeTensorMode, detect_fake_mode, tree_flatten, tree_map_only, unset_fake_temporarily

__all__ = ["splice"]


# Traces reused as templates (blocks repeat, and so do their rewrites), keyed by the caller's key and the
# inputs' metadata; the nodes copied from a reused trace get fresh fake values.
_traces: OrderedDict[tuple, fx.GraphModule] = OrderedDict()
_MAX_TRACES = 256


def _signature(val: object) -> object:
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), val.dtype, tuple(val.stride()), val.device)
    return val


def _reusable_key(cache_key: Hashable | None, vals: Sequence[object]) -> Hashable | None:
    """The key of a trace on ``vals``, or ``None`` where it must not be reused (symbolic sizes)."""
    if cache_key is None:
        return None
    key = (cache_key, tuple(_signature(v) for v in vals))
    return None if _symbolic(key) else key


def _symbolic(value: object) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_symbolic(v) for v in value)
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def splice(graph: fx.Graph, fn: Callable[..., object], inputs: Sequence[fx.Node], *, before: fx.Node,
           meta: dict[str, object] | None = None, inserted: list[fx.Node] | None = None,
           cache_key: Hashable | None = None) -> list[fx.Node]:
    """Insert ``fn(*inputs)`` before ``before``; return the nodes of its (flattened) outputs.

    Each new node's ``meta["fsdp"]`` is updated with ``meta``, and appended to ``inserted`` if given.
    ``cache_key`` (what ``fn`` depends on besides its inputs) lets a later call reuse the trace.
    """
    vals = [n.meta["val"] for n in inputs]
    mode = detect_fake_mode(vals)
    ctx = mode if mode is not None else contextlib.nullcontext()
    key = _reusable_key(cache_key, vals)
    traced = _traces.get(key) if key is not None else None
    reused = traced is not None
    if traced is None:
        with ctx:
            traced = make_fx(lambda *xs: fn(*xs))(*vals)
        if key is not None:
            _traces[key] = traced
            while len(_traces) > _MAX_TRACES:
                _traces.popitem(last=False)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(inputs), (len(placeholders), len(inputs))
    env: dict[fx.Node, fx.Node] = dict(zip(placeholders, inputs))
    replayed = _replay(traced, placeholders, vals, mode) if reused and mode is not None else None
    outputs: list[fx.Node] = []
    with graph.inserting_before(before):
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                flat, _ = tree_flatten(node.args[0])
                outputs = [env[o] for o in flat]
                break
            if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
                env[node] = env[node.args[0]]  # type: ignore[index]
                continue
            new = graph.node_copy(node, lambda n: env[n])
            if reused:  # a value of its own, not the template's
                if replayed is not None:
                    new.meta["val"] = replayed[node]
                else:  # run the op on its inputs' fake values
                    args, kwargs = tree_map_only(fx.Node, lambda n: n.meta["val"], (new.args, new.kwargs))
                    with ctx, torch.no_grad():
                        new.meta["val"] = new.target(*args, **kwargs)  # type: ignore[operator]
            if meta:
                new.meta.setdefault("fsdp", {}).update(meta)
            if inserted is not None:
                inserted.append(new)
            env[node] = new
    return outputs


def _replay(traced: fx.GraphModule, placeholders: Sequence[fx.Node], vals: Sequence[object],
            mode: FakeTensorMode) -> dict[fx.Node, object] | None:
    """NOTE [replayed values]: fresh fake values for a reused trace's nodes without running their ops.

    Each value copies its template's metadata on storage of its own, or on the new counterpart of a storage
    the template shared with an input or another value (a view stays a view). Built on the meta device and
    wrapped in the graph's fake mode, cheaper than running the ops. ``None`` (run the ops instead) where a
    value is not a tensor or a sequence of tensors.
    """
    storages: dict[int, object] = {}
    for p, v in zip(placeholders, vals):
        t = p.meta.get("val")
        if isinstance(t, torch.Tensor) and isinstance(v, torch.Tensor):
            storages[t.untyped_storage()._cdata] = v.untyped_storage()
    converter = mode.fake_tensor_converter

    def fresh(t: object) -> object:
        if not isinstance(t, torch.Tensor):
            raise TypeError(type(t))
        key = t.untyped_storage()._cdata
        if key not in storages:
            nbytes = t.untyped_storage().nbytes()
            storages[key] = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
        meta = torch.empty(0, dtype=t.dtype, device="meta").set_(storages[key], t.storage_offset(), t.shape, t.stride())
        return converter.from_meta_and_device(mode, meta, t.device)

    out: dict[fx.Node, object] = {}
    try:
        with unset_fake_temporarily():  # meta tensors, outside any active fake mode
            for node in traced.graph.nodes:
                if node.op in ("placeholder", "output"):
                    continue
                val = node.meta.get("val")
                out[node] = type(val)(fresh(t) for t in val) if isinstance(val, (list, tuple)) else fresh(val)
    except (TypeError, RuntimeError, AttributeError):
        return None
    return out
