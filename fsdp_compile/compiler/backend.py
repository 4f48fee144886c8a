"""``fsdp_backend`` and ``make_backend``: AOTAutograd, a resharding partition, the passes, Inductor.

``torch.compile(model, backend=fsdp_backend)`` on a model prepared with ``fully_shard``:

1. AOTAutograd traces the joint forward+backward graph with Inductor's decompositions (after
   Inductor's pre-grad passes, as ``torch.compile`` runs them); the graph holds ``fsdp::unshard``
   markers in forward and ``fsdp::reduce_grad`` markers in backward.
2. ``partition`` (``partition.py``) runs Inductor's joint-graph passes, marks each unshard of a
   resharding unit must-recompute, then min-cut partitions: forward saves the *shard* and backward
   gathers again (see NOTE [reshard by recompute]).
3. The passes (``passes/``) lower markers to collectives on the two groups and schedule them; the
   streams are checked, every rank's collective sequence is compared (NOTE [agreement]), and the
   schedule goes to logs and dumps.
4. Inductor compiles each graph (``compile_fx_inner``, the order pinned), or, with ``inductor=False``,
   the scheduled FX graphs run as they are (for debugging).

With Inductor's caches on, a later process start loads the compiled graphs from AOTAutograd's cache and
skips steps 1-4 (NOTE [warm start] in ``cache.py``).

Outlined units (NOTE [outlined units] in ``module.py``) reach the backend as calls of one
``invoke_subgraph`` body per kind of block; before step 1 their markers move out to the calls
(``passes/capture/hoist.py``) and are named after the shards they read, and bodies that cannot stay outlined
(``outline=False``, a marker left inside) are inlined.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import fx, nn

from fsdp_compile.passes import NamedPass, run_passes
from fsdp_compile.passes.capture.group_markers import group_markers_pass
from fsdp_compile.passes.capture.inline import inline_subgraphs_pass
from fsdp_compile.passes.capture.outline import outline_blocks_pass
from fsdp_compile.passes.capture.unroll import unroll_scans_pass
from fsdp_compile.passes.lower.bucket import bucket_pass
from fsdp_compile.passes.lower.expand_markers import expand_markers_pass
from fsdp_compile.passes.lower.grouped import lower_grouped_pass
from fsdp_compile.passes.lower.per_param import lower_reduce_grad_pass, lower_unshard_pass
from fsdp_compile.passes.lower.share import share_subgraphs_pass
from fsdp_compile.passes.lower.tiles import tiles_pass
from fsdp_compile.passes.schedule.absorb import absorb_copies_pass
from fsdp_compile.passes.schedule.prefetch import prefetch_pass
from fsdp_compile.passes.schedule.reduce_scatter import SCHEDULES, reduce_scatter_pass
from fsdp_compile.passes.schedule.streams import check_streams, streams_pass

from fsdp_compile.api import markers as _ops  # noqa: F401  (registers the marker ops)
from fsdp_compile.safety import agreement
from fsdp_compile.inspection import autotune
from fsdp_compile.compiler import cache
from fsdp_compile.safety import lockstep
from fsdp_compile._compat import (
    aot_autograd,
    compile_fx_inner,
    donate_no_saved_tensors,
    forward_user_outputs,
    inductor_config_patch,
    inductor_pre_grad_passes,
    keep_output_strides,
    lowering_outlined_bodies,
    make_boxed_func,
    region_schemas_once,
    resolve_group,
    restarts_the_trace,
    select_decomp_table,
    serializable,
    structured_trace_on,
    timed,
)
from fsdp_compile.inspection.autotune import Choice
from fsdp_compile.compiler.collector import defer_full_collections_while_compiling, no_full_collections
from fsdp_compile.inspection.cost import Hardware, detect_hardware, load_hardware
from fsdp_compile.inspection.dump import dump, report
from fsdp_compile.inspection.logs import log_schedule, schedule_logged
from fsdp_compile.api.module import OUTLINES, is_outline_candidate
from fsdp_compile.compiler.partition import partition
from fsdp_compile.api.flat_shard import flat_check, is_flat
from fsdp_compile.compiler.outlined_markers import outer_markers
from fsdp_compile.api.units import is_sharded

__all__ = ["BackendOptions", "make_backend", "fsdp_backend", "observe_graphs"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendOptions:
    """Settings of one backend made by :func:`make_backend`, which takes them by keyword; each is
    documented below. Paths are kept as ``str`` and ``disabled_passes`` as a tuple."""

    schedule: str = "eager"
    """``"eager"`` launches each unit's reduce-scatter as soon as its gradients exist (use with the
    dedicated reduce-scatter communicator of ``FsdpGroups``); ``"delayed"`` holds it until the next
    unit's backward all-gather is issued (the baseline, meant for ``dedicated="none"``)."""
    prefetch: int | str = 1
    """Units whose all-gather is issued ahead of use (0: none); ``"auto"`` picks it with the cost model
    (the smallest depth within 0.5% of the best estimated step)."""
    prefetch_bytes: int | None = None
    """Cap on bytes gathered but not yet used (``None``: only ``prefetch`` bounds it)."""
    reduce_scatter_bytes: int | str | None = "auto"
    """Cap on reduce-scatter input bytes in flight; ``"auto"`` (default) keeps one unit's in flight, or,
    when ``hardware`` is named, picks the smallest cap within 0.5% of the best estimated step; ``None``
    lets every wait sink to the end of backward."""
    inductor: bool = True
    """``False`` runs the scheduled FX graphs without Inductor (for debugging)."""
    pin_order: bool = True
    """``False`` lets Inductor reorder collectives by its own memory heuristics (for comparison)."""
    elide_single_rank: bool = True
    """``False`` keeps the collectives of one-rank groups (for measuring their cost)."""
    inplace_gather: bool = True
    """``False`` packs each all-gather bucket into a buffer of its own instead of into its slice of the
    output (NOTE [in-place all-gather] in ``passes/lower/bucket.py``; for comparison)."""
    bucket_alone_bytes: int | None = 16 << 20
    """A parameter at least this large (full size, bytes) keeps an all-gather and a reduce-scatter of its
    own, which need no pack or unpack copy; smaller ones share their unit's bucket (NOTE [large params
    alone]); ``None`` buckets every parameter."""
    check_agreement: bool = True
    """Before a compiled graph runs, compare its collective sequence with every peer rank's and raise on a
    difference (NOTE [agreement]), and notice ranks that run different sequences of compiled graphs
    (NOTE [lockstep]); a peer that failed or is gone is named within seconds, one blocked inside a graph
    call that needs this rank after ``peers.STUCK_S``, one that is alive elsewhere after
    ``agreement_timeout_s``."""
    agreement_timeout_s: float | None = None
    """Seconds to wait for a live peer in the agreement check (``None``: the process group's timeout)."""
    dump_dir: str | os.PathLike[str] | None = None
    """Write each compiled graph's schedule (table, Chrome trace, PNG timeline) there, one set of files
    per graph and rank."""
    hardware: str | None = None
    """A preset of ``cost.HARDWARE`` (default: this device's) for the cost model behind the estimated
    times in dumps, logs and ``"auto"`` settings."""
    calibration: str | os.PathLike[str] | None = None
    """A JSON of measured numbers for the cost model."""
    disabled_passes: Sequence[str] = ()
    """Passes switched off by name (``PASS_NAMES``)."""
    log_pass_diffs: bool = False
    """Log each pass's diff."""
    outline: bool = True
    """``True``: units that ``fully_shard`` outlined (the repeated blocks, NOTE [outlined units] in
    module.py) are traced as one body each kind, compiled once and called once per unit, for a compile
    time that grows slowly with depth; their collectives stay in the whole-model graph and are scheduled
    across units as before, and they reshard after forward as inline units do. ``False`` traces every
    block inline (one whole-model graph). Not applied where the cost model picks settings (``"auto"``
    above): it needs to see every op."""

    def __post_init__(self) -> None:
        for name in ("dump_dir", "calibration"):  # (frozen: set through object)
            if getattr(self, name) is not None:
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        object.__setattr__(self, "disabled_passes", tuple(self.disabled_passes))
        if self.schedule not in SCHEDULES:
            raise ValueError(f"make_backend: schedule={self.schedule!r}; use one of {SCHEDULES}")
        if self.prefetch != "auto" and (
            not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or self.prefetch < 0
        ):
            raise ValueError(
                f"make_backend: prefetch={self.prefetch!r}; use an int >= 0 (units gathered ahead) or 'auto'"
            )
        for name in ("prefetch_bytes", "reduce_scatter_bytes", "bucket_alone_bytes"):
            value = getattr(self, name)
            if value is None or value == "auto" and name == "reduce_scatter_bytes":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"make_backend: {name}={value!r}; use a positive number of bytes or None")
        timeout = self.agreement_timeout_s
        if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0):
            raise ValueError(f"make_backend: agreement_timeout_s={timeout!r}; use a positive number of seconds, or "
                             "None for the process group's timeout")
        unknown = set(self.disabled_passes) - set(PASS_NAMES)
        if unknown:
            raise ValueError(f"make_backend: disabled_passes {sorted(unknown)} match no pass; known: {list(PASS_NAMES)}")

    def uses_cost_model(self) -> bool:
        """Whether a schedule setting is picked by the cost model (``"auto"``, see ``_schedule``)."""
        return self.prefetch == "auto" or (self.reduce_scatter_bytes == "auto" and self.hardware is not None)

    def outlines(self) -> bool:
        """Keep outlined units' bodies (NOTE [outlined units]), except when the cost model picks
        settings: it estimates compute node by node and does not see inside a subgraph call."""
        return self.outline and not self.uses_cost_model()

    def cost_model(self) -> Hardware:
        """The hardware model behind estimates and ``"auto"``: the named preset, else this device's."""
        if self.hardware is None and self.calibration is None:
            return detect_hardware()
        return load_hardware(self.hardware or detect_hardware(), self.calibration)


PASS_NAMES = ("lower_unshard", "lower_reduce_grad", "bucket", "tiles", "prefetch", "reduce_scatter", "streams", "absorb")
_graph_ids = itertools.count()
_observers: list[Callable[[str, fx.GraphModule], None]] = []


@contextlib.contextmanager
def observe_graphs() -> Iterator[list[tuple[str, fx.GraphModule]]]:
    """Collect ``(kind, graph)`` for every graph the backend hands on while the context is open.

    ``kind`` is ``"forward"``, ``"backward"`` or ``"inference"``; the graph is the scheduled FX graph
    exactly as given to Inductor (or run as is, with ``inductor=False``).
    """
    seen: list[tuple[str, fx.GraphModule]] = []
    observer = lambda kind, gm: seen.append((kind, gm))  # noqa: E731
    _observers.append(observer)
    try:
        yield seen
    finally:
        _observers.remove(observer)


def _lowering(options: BackendOptions) -> list[NamedPass]:
    lower = functools.partial(lower_unshard_pass, elide_single_rank=options.elide_single_rank)
    reduce = functools.partial(lower_reduce_grad_pass, elide_single_rank=options.elide_single_rank)
    rank_of = (lambda group: resolve_group(group).rank()) if options.inplace_gather else None
    bucket = functools.partial(bucket_pass, rank_of=rank_of, alone_bytes=options.bucket_alone_bytes)
    passes = [NamedPass("lower_unshard", lower), NamedPass("lower_reduce_grad", reduce), NamedPass("bucket", bucket),
              NamedPass("tiles", tiles_pass)]  # NOTE [tiled gradients]
    expand = NamedPass("expand_markers", expand_markers_pass)  # NOTE [flat markers]
    if {p.name for p in passes} & set(options.disabled_passes):  # each step seen apart: no shortcut
        return [expand, *passes]
    grouped = functools.partial(lower_grouped_pass, elide_single_rank=options.elide_single_rank, rank_of=rank_of,
                                alone_bytes=options.bucket_alone_bytes)
    return [NamedPass("lower_grouped", grouped), expand, *passes]  # NOTE [grouped lowering]


def _scheduling(options: BackendOptions, choice: Choice) -> list[NamedPass]:
    prefetch = functools.partial(prefetch_pass, depth=choice.prefetch, max_bytes=options.prefetch_bytes)
    scatter = functools.partial(reduce_scatter_pass, schedule=options.schedule, max_bytes=choice.reduce_scatter_bytes)
    return [NamedPass("prefetch", prefetch), NamedPass("reduce_scatter", scatter), NamedPass("streams", streams_pass),
            NamedPass("absorb", absorb_copies_pass)]


def _schedule(gm: fx.GraphModule, options: BackendOptions, hw: Hardware) -> fx.GraphModule:
    """All passes, in order; ``"auto"`` settings resolved on the bucketed graph with the cost model."""
    skip, diff = options.disabled_passes, options.log_pass_diffs
    gm = run_passes(gm, _lowering(options), disabled=skip, log_diff=diff, allow_unknown=True, recompile=False)
    if options.uses_cost_model():
        choice = autotune.choose(gm, hw, prefetch=options.prefetch, prefetch_bytes=options.prefetch_bytes,
                                 schedule=options.schedule, reduce_scatter_bytes=options.reduce_scatter_bytes)
    else:
        choice = Choice(prefetch=int(options.prefetch), reduce_scatter_bytes=options.reduce_scatter_bytes)
    gm = run_passes(gm, _scheduling(options, choice), disabled=skip, log_diff=diff, allow_unknown=True)
    if "streams" not in skip:
        check_streams(gm)  # the annotations say what runs where: NOTE [streams]
    return gm


def _compile(gm: fx.GraphModule, example_inputs: Sequence[Any], **kw: Any) -> Callable[..., Any]:
    with no_full_collections():  # NOTE [no full collections] (a backward compiles at its first call)
        return _compile_graph(gm, example_inputs, **kw)


def _compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: BackendOptions,
    hw: Hardware,
    is_backward: bool,
    is_inference: bool,
) -> Callable[..., Any]:
    if not is_backward and not is_inference:
        donate_no_saved_tensors()  # NOTE [no donated buffers]: backward(retain_graph=True) at any step
    # NOTE [compile-time keys]: each stage of ours adds to torch.compile's timing table under an
    # ``fsdp.*`` key (benchmarks/compile_stages.py reads them beside Dynamo's, AOTAutograd's, Inductor's).
    with timed("fsdp.passes"):
        gm = _schedule(share_subgraphs_pass(gm, recompile=False), options, hw)
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
    compiled = _inductor(gm, example_inputs, options=options, graph_id=graph_id, is_backward=is_backward,
                         is_inference=is_inference) if options.inductor else make_boxed_func(gm.forward)
    return lockstep.note_failures(compiled, boxed=True) if identity is not None else compiled


def _inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: BackendOptions, graph_id: int,
              is_backward: bool, is_inference: bool) -> Callable[..., Any]:
    # NOTE [pinning the schedule]: Inductor's memory-driven reordering moves collectives back next to
    # their waits (prefetches sink, reduce-scatter waits rise), undoing the schedule. With it off, the
    # generated code issues collectives and waits in the FX order (tests/test_schedules.py checks
    # the emitted code). Patched per compile, never globally.
    # With outlined bodies, Inductor's memory reordering gave wrong gradients (NOTE [regions for our
    # backend only] in module.py): it stays off for them even with pin_order=False.
    keep_output_strides(gm, None if is_backward or is_inference else forward_user_outputs())  # NOTE [output strides]
    calls = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    patches = {"reorder_for_peak_memory": False} if options.pin_order or calls else {}
    with inductor_config_patch(patches), lowering_outlined_bodies():  # NOTE [donated subgraph inputs]
        return compile_fx_inner(
            gm,
            example_inputs,
            is_backward=is_backward,
            is_inference=is_inference,
            graph_id=graph_id,
        )


def make_backend(**options: Any) -> Any:
    """A ``torch.compile`` backend for models prepared with ``fully_shard``.

    ``options``: the fields of :class:`BackendOptions`, by keyword (each documented there); an unknown
    name raises ``TypeError``, a bad value ``ValueError``.
    Which collective gets a communicator of its own comes from the ``FsdpGroups`` the model was
    sharded with.
    With Inductor's caches on (torch's default), a later process start loads what this backend compiled
    instead of compiling again (NOTE [warm start] in ``cache.py``); ``dump_dir``, ``log_pass_diffs``,
    ``observe_graphs``, ``TORCH_LOGS=fsdp_compile`` and ``TORCH_TRACE`` (tlparse) compile afresh, so that
    they show the schedule.
    """
    known = [f.name for f in fields(BackendOptions)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"make_backend: unknown option(s) {unknown}; the options are {known} (see BackendOptions)")
    return _make_backend(BackendOptions(**options))


def _make_backend(options: BackendOptions) -> Any:
    """The backend of ``options``: AOTAutograd with our partition and compilers, the passes before it."""
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
        defer_full_collections_while_compiling()  # NOTE [no full collections]: to this compile's end
        with no_full_collections():
            return _backend(gm, example_inputs)

    def _backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        _refuse_unmanaged_params(gm, example_inputs)
        with timed("fsdp.outline"):
            if options.outlines():
                gm = outline_blocks_pass(gm, is_block=is_outline_candidate)  # NOTE [outlining by proof]
            gm = unroll_scans_pass(gm)  # NOTE [unrolled stacks]
            gm = outer_markers(gm, example_inputs, keep_bodies=options.outlines())
        gm = inductor_pre_grad_passes(gm, example_inputs)
        with timed("fsdp.outline"):
            gm = group_markers_pass(gm)  # NOTE [flat markers]: lowered or split again in _compile
        cached = _cacheable(options)
        if cached:
            setattr(gm, cache.ATTRIBUTE, cache.cache_key(gm, settings))
        compiled = _aot_or_inline(aot_cached if cached else aot_uncached, gm, example_inputs)
        compiled = _checking_flats(compiled, flat_check(example_inputs))  # NOTE [flat shards] in flat.py
        return lockstep.note_failures(compiled) if options.check_agreement else compiled

    setattr(backend, OUTLINES, options.outlines())  # NOTE [regions for our backend only]
    return backend


def _aot_or_inline(aot: Callable[..., Any], gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """``aot(gm, example_inputs)``; where AOTAutograd cannot take an outlined body, the same graph with
    every body inlined (exact, as every block was traced inline: NOTE [outlining by proof]), and one
    INFO line that says why."""
    try:
        with region_schemas_once():
            return aot(gm, example_inputs)
    except Exception as error:  # noqa: BLE001 (any failure inside a body: fall back, never crash)
        calls = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
        if not calls or restarts_the_trace(error):
            raise
        log.info("fsdp_backend: outlined blocks could not be compiled as shared bodies (%s: %s); "
                 "compiling them inline", type(error).__name__, str(error).splitlines()[0] if str(error) else "")
    return aot(inline_subgraphs_pass(gm), example_inputs)


def _checking_flats(compiled: Callable[..., Any], check: Callable[[], None] | None) -> Callable[..., Any]:
    """``compiled``, checking before each call that the parameters are still views of the flat shards it
    reads (NOTE [flat shards] in ``flat.py``: ``p.data = t`` copied back in, or an error)."""
    if check is None:
        return compiled

    def run(*args: Any) -> Any:
        check()
        return compiled(*args)

    functools.update_wrapper(run, compiled)
    return run


def _cacheable(options: BackendOptions) -> bool:
    """Whether AOTAutograd's cache may serve this compile (NOTE [warm start] in ``cache.py``): not
    where the user asked to see each compile's schedule (a dump, the log, tlparse's trace)."""
    shown = (options.dump_dir is not None or options.log_pass_diffs or _observers or schedule_logged()
             or structured_trace_on())
    return options.inductor and not shown


def _refuse_unmanaged_params(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """A graph that reads sharded params must not also train params outside every unit: their
    gradients would never be averaged across ranks, and replicas would silently drift apart."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    named = [(n.name, t) for n, t in zip(placeholders, example_inputs) if isinstance(t, nn.Parameter)]
    named += [(name, p) for name, p in gm.named_parameters()]
    if not any(is_sharded(p) for _, p in named) and not any(is_flat(t) for t in example_inputs):
        return  # not an FSDP model: plain Inductor
    loose = [name for name, p in named if p.requires_grad and not is_sharded(p)]
    if loose:
        raise ValueError(
            f"fsdp_backend: trainable parameters {loose} are not managed by any fully_shard unit, so their "
            "gradients would not be averaged across ranks. Call fully_shard(model, groups=groups) on the "
            "root after its blocks (it takes every remaining parameter), or freeze them "
            "(param.requires_grad_(False))."
        )


fsdp_backend = make_backend()
