"""``fsdp_backend`` and ``make_backend``: Dynamo's graph through the capture passes, AOTAutograd with the
resharding partition (NOTE [reshard by recompute]), the lowering and scheduling passes, the agreement
check (NOTE [agreement]), then Inductor with the order pinned (or, with ``inductor=False``, the FX graphs
as they are). A warm start loads the compiled graphs from AOTAutograd's cache (NOTE [warm start]).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields
from typing import Any

import torch
from torch import fx, nn

from fsdp_compile._compat import (aot_autograd, compile_fx_inner, donate_no_saved_tensors, forward_user_outputs,
                                  inductor_config_patch, inductor_pre_grad_passes, keep_output_strides,
                                  lowering_outlined_bodies, make_boxed_func, region_schemas_once, restarts_the_trace,
                                  select_decomp_table, serializable, structured_trace_on, timed)
from fsdp_compile.api import markers as _ops  # noqa: F401  (registers the marker ops)
from fsdp_compile.api.flat_shard import as_pieces, elided_flats, flat_inputs, is_flat
from fsdp_compile.api.module import OUTLINES
from fsdp_compile.api.units import is_sharded
from fsdp_compile.compiler import cache
from fsdp_compile.compiler.collector import defer_full_collections_while_compiling, no_full_collections
from fsdp_compile.compiler.outlined_markers import read_params
from fsdp_compile.compiler.partition import partition
from fsdp_compile.compiler.pipeline import (CAPTURE, FALLBACK, GROUPING, INPUTS, LOWERING, SCHEDULING, BackendOptions,
                                            Context, run_stage, scheduler)
from fsdp_compile.inspection import autotune
from fsdp_compile.inspection.cost import Hardware
from fsdp_compile.inspection.dump import dump, report
from fsdp_compile.inspection.logs import log_schedule, schedule_logged
from fsdp_compile.passes._compat import static_fake
from fsdp_compile.passes.schedule.streams import check_streams
from fsdp_compile.safety import agreement, lockstep

__all__ = ["BackendOptions", "make_backend", "fsdp_backend", "observe_graphs"]

log = logging.getLogger(__name__)
_graph_ids = itertools.count()
_observers: list[Callable[[str, fx.GraphModule], None]] = []


@contextlib.contextmanager
def observe_graphs() -> Iterator[list[tuple[str, fx.GraphModule]]]:
    """Collect ``(kind, graph)`` for every scheduled FX graph the backend hands to Inductor (or runs) while
    the context is open; ``kind`` is ``"forward"``, ``"backward"`` or ``"inference"``."""
    seen: list[tuple[str, fx.GraphModule]] = []
    observer = lambda kind, gm: seen.append((kind, gm))  # noqa: E731
    _observers.append(observer)
    try:
        yield seen
    finally:
        _observers.remove(observer)


def _schedule(gm: fx.GraphModule, options: BackendOptions, hw: Hardware) -> fx.GraphModule:
    """Lowering, then scheduling, with ``"auto"`` settings chosen on the bucketed graph."""
    gm = run_stage(gm, LOWERING, Context(options), recompile=False)
    if options.uses_cost_model():
        choice = autotune.choose(gm, hw, prefetch=options.prefetch, reduce_scatter_bytes=options.reduce_scatter_bytes,
                                 schedule=scheduler(options))
    else:
        choice = autotune.Choice(prefetch=int(options.prefetch), reduce_scatter_bytes=options.reduce_scatter_bytes)
    gm = run_stage(gm, SCHEDULING, Context(options, choice=choice))
    if "streams" not in options.disabled_passes:
        check_streams(gm)  # the annotations say what runs where: NOTE [streams]
    return gm


def _compile(gm: fx.GraphModule, example_inputs: Sequence[Any], **kw: Any) -> Callable[..., Any]:
    with no_full_collections():  # NOTE [no full collections]
        return _compile_graph(gm, example_inputs, **kw)


def _compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: BackendOptions, hw: Hardware,
                   is_backward: bool, is_inference: bool) -> Callable[..., Any]:
    if not is_backward and not is_inference:
        donate_no_saved_tensors()  # NOTE [no donated buffers]: backward(retain_graph=True) at any step
    # NOTE [compile-time keys]: each stage of ours adds to torch.compile's timing table under an ``fsdp.*`` key.
    with timed("fsdp.passes"):
        gm = _schedule(gm, options, hw)
    kind = "backward" if is_backward else "inference" if is_inference else "forward"
    identity = None
    if options.check_agreement:
        with timed("fsdp.agreement"):
            identity = agreement.identify(gm, kind, options.agreement_timeout_s)
            if identity is not None:
                agreement.check_agreement(identity)
                gm = lockstep.insert_check_in(gm, identity)  # NOTE [lockstep]
    graph_id = next(_graph_ids)
    with timed("fsdp.report"):
        log_schedule(kind, lambda: report(gm, hw))
        if options.dump_dir is not None:
            dump(gm, options.dump_dir, f"{kind}_{graph_id}", hw)
    for observer in _observers:
        observer(kind, gm)
    compiled = _inductor(gm, example_inputs, graph_id=graph_id, is_backward=is_backward,
                         is_inference=is_inference) if options.inductor else make_boxed_func(gm.forward)
    return lockstep.note_failures(compiled, boxed=True) if identity is not None else compiled


def _inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], *, graph_id: int, is_backward: bool,
              is_inference: bool) -> Callable[..., Any]:
    # NOTE [pinning the schedule]: Inductor's memory-driven reordering moves collectives back next to their
    # waits, undoing the schedule (and with outlined bodies gives wrong gradients). With it off, per compile,
    # the generated code issues collectives and waits in the FX order.
    keep_output_strides(gm, None if is_backward or is_inference else forward_user_outputs())  # NOTE [output strides]
    pinned = inductor_config_patch({"reorder_for_peak_memory": False})
    with pinned, lowering_outlined_bodies():  # NOTE [donated subgraph inputs]
        return compile_fx_inner(gm, example_inputs, is_backward=is_backward, is_inference=is_inference,
                                graph_id=graph_id)


def make_backend(**options: Any) -> Any:
    """A ``torch.compile`` backend for models prepared with ``fully_shard``.

    ``options``: the fields of :class:`BackendOptions`, by keyword; an unknown name raises ``TypeError``,
    a bad value ``ValueError``. With Inductor's caches on, a later process start loads what this backend
    compiled (NOTE [warm start]), except under ``dump_dir``, ``log_pass_diffs``, ``observe_graphs``,
    ``TORCH_LOGS=fsdp_compile`` and ``TORCH_TRACE``, which show each compile's schedule.
    """
    known = [f.name for f in fields(BackendOptions)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"make_backend: unknown option(s) {unknown}; the options are {known} (see BackendOptions)")
    return _make_backend(BackendOptions(**options))


def _make_backend(options: BackendOptions) -> Any:
    hw = options.cost_model()  # once: an unknown preset or a bad calibration file fails here
    compile_fw = functools.partial(_compile, options=options, hw=hw, is_backward=False, is_inference=False)
    compile_bw = functools.partial(_compile, options=options, hw=hw, is_backward=True, is_inference=False)
    compile_inf = functools.partial(_compile, options=options, hw=hw, is_backward=False, is_inference=True)

    def aot(cached: bool) -> Callable[..., Any]:
        wrap = serializable if cached else (lambda compiler: compiler)  # NOTE [warm start]
        return aot_autograd(fw_compiler=wrap(compile_fw), bw_compiler=wrap(compile_bw),
                            inference_compiler=wrap(compile_inf), partition_fn=partition,
                            decompositions=select_decomp_table())

    aot_cached, aot_uncached = aot(True), aot(False)
    settings = repr((options, hw))

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        defer_full_collections_while_compiling()  # NOTE [no full collections]
        with no_full_collections():
            return _backend(gm, example_inputs)

    def _backend(gm: fx.GraphModule, given: Sequence[Any]) -> Any:
        _refuse_unmanaged_params(gm, given)
        gm, split = _split_elided_flats(gm, given, options)
        inputs = as_pieces(given, split)  # the real tensors, which name the markers
        with timed("fsdp.outline"):
            gm = run_stage(gm, CAPTURE, Context(options, inputs))
        read = read_params(gm)  # (before grouping)
        gm = inductor_pre_grad_passes(gm, inputs)
        with timed("fsdp.outline"):
            gm = run_stage(gm, GROUPING, Context(options))
        cached = _cacheable(options)
        if cached:
            setattr(gm, cache.ATTRIBUTE, cache.cache_key(gm, settings))
        # AOTAutograd gets the split parameters as fakes with static sizes (NOTE [elided flats])
        traced = as_pieces(given, split, static_fake) if split else inputs
        compiled = _aot_or_inline(aot_cached if cached else aot_uncached, gm, traced, options)
        compiled = _with_flat_inputs(compiled, flat_inputs(given, split, read))  # NOTE [flat shards]
        return lockstep.note_failures(compiled) if options.check_agreement else compiled

    setattr(backend, OUTLINES, options.outlines())  # NOTE [regions for our backend only]
    return backend


def _aot_or_inline(aot: Callable[..., Any], gm: fx.GraphModule, example_inputs: Sequence[Any],
                   options: BackendOptions) -> Any:
    """``aot(gm, example_inputs)``; where AOTAutograd cannot take an outlined body, the graph with every
    body inlined (NOTE [outlining by proof]), and an INFO line that says why."""
    try:
        with region_schemas_once():
            return aot(gm, example_inputs)
    except Exception as error:  # noqa: BLE001 (any failure inside a body: fall back, never crash)
        calls = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
        if not calls or restarts_the_trace(error):
            raise
        log.info("fsdp_backend: outlined blocks could not be compiled as shared bodies (%s: %s); "
                 "compiling them inline", type(error).__name__, str(error).splitlines()[0] if str(error) else "")
    return aot(run_stage(gm, FALLBACK, Context(options)), example_inputs)


def _split_elided_flats(gm: fx.GraphModule, example_inputs: Sequence[Any],
                       options: BackendOptions) -> tuple[fx.GraphModule, frozenset[int]]:
    """Where one-rank units' collectives are elided, their flat shards are read as their parameters
    (NOTE [elided flats]); returns the indices of the inputs split."""
    flats = elided_flats(example_inputs) if options.elide_single_rank else {}
    if not flats:
        return gm, frozenset()
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    pieces = {names[i]: [(sp.offset, sp.shard.numel(), tuple(sp.shard.shape)) for sp in members]
              for i, members in flats.items()}
    gm = run_stage(gm, INPUTS, Context(options, pieces=pieces))
    left = {n.name for n in gm.graph.find_nodes(op="placeholder")}
    return gm, frozenset(i for i in flats if names[i] not in left)


def _with_flat_inputs(compiled: Callable[..., Any], prepare: Callable[[Sequence[Any]], list[Any]] | None
                      ) -> Callable[..., Any]:
    """``compiled``, called with what ``prepare`` (``flat_inputs``) makes of each call's arguments."""
    if prepare is None:
        return compiled

    def run(*args: Any) -> Any:
        return compiled(*prepare(args))

    functools.update_wrapper(run, compiled)
    return run


def _cacheable(options: BackendOptions) -> bool:
    """Whether AOTAutograd's cache may serve this compile: not where the user asked to see each
    compile's schedule (NOTE [warm start])."""
    shown = (options.dump_dir is not None or options.log_pass_diffs or _observers or schedule_logged()
             or structured_trace_on())
    return options.inductor and not shown


def _refuse_unmanaged_params(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Raise where a graph of sharded params also trains params outside every unit (never averaged)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    named = [(n.name, t) for n, t in zip(placeholders, example_inputs) if isinstance(t, nn.Parameter)]
    named += [(name, p) for name, p in gm.named_parameters()]
    if not any(is_sharded(p) for _, p in named) and not any(is_flat(t) for t in example_inputs):
        return  # not an FSDP model: plain Inductor
    loose = [name for name, p in named if p.requires_grad and not is_sharded(p)]
    if loose:
        raise ValueError(f"fsdp_backend: trainable parameters {loose} are not managed by any fully_shard unit, so "
                         "their gradients would not be averaged across ranks. Call fully_shard(model, groups=groups) "
                         "on the root after its blocks (it takes every remaining parameter), or freeze them "
                         "(param.requires_grad_(False)).")


fsdp_backend = make_backend()
