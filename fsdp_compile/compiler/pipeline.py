"""The backend's options, and the passes they bind, stage by stage.

Each stage is a tuple of ``(name, build)``: ``build`` binds a pass to one compile's options, and
:func:`run_stage` runs them through ``run_passes``. ``PASS_NAMES`` (what ``disabled_passes`` accepts) is
every name of every stage. ``CAPTURE`` and ``GROUPING`` run on Dynamo's graph before AOTAutograd,
``LOWERING`` and ``SCHEDULING`` on each graph AOTAutograd hands on, ``FALLBACK`` where AOTAutograd cannot
take an outlined body.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from fsdp_compile._compat import resolve_group
from fsdp_compile.api.module import is_outline_candidate
from fsdp_compile.compiler.outlined_markers import name_markers, worth_a_call
from fsdp_compile.inspection.autotune import Choice
from fsdp_compile.inspection.cost import Hardware, detect_hardware, load_hardware
from fsdp_compile.passes import GraphPass, NamedPass, run_passes
from fsdp_compile.passes.capture.flat_inputs import Piece, split_flat_inputs_pass
from fsdp_compile.passes.capture.group_markers import group_markers_pass
from fsdp_compile.passes.capture.hoist import hoist_unshards_pass
from fsdp_compile.passes.capture.inline import inline_nested_pass, inline_subgraphs_pass
from fsdp_compile.passes.capture.outline import outline_blocks_pass
from fsdp_compile.passes.capture.unroll import unroll_scans_pass
from fsdp_compile.passes.lower.markers import lower_markers_pass
from fsdp_compile.passes.lower.share import share_subgraphs_pass
from fsdp_compile.passes.schedule.absorb import absorb_copies_pass
from fsdp_compile.passes.schedule.prefetch import prefetch_pass
from fsdp_compile.passes.schedule.reduce_scatter import SCHEDULES, reduce_scatter_pass
from fsdp_compile.passes.schedule.streams import streams_pass

__all__ = ["BackendOptions", "Context", "PASS_NAMES", "STAGES", "run_stage", "scheduler"]


@dataclass(frozen=True)
class BackendOptions:
    """Settings of one backend made by :func:`make_backend`, which takes them by keyword. Paths are kept
    as ``str`` and ``disabled_passes`` as a tuple."""

    schedule: str = "eager"
    """``"eager"`` launches each unit's reduce-scatter as soon as its gradients exist (for a dedicated
    reduce-scatter communicator); ``"delayed"`` holds it until the next unit's backward all-gather is
    issued (meant for ``dedicated="none"``)."""
    prefetch: int | str = 1
    """Units whose all-gather is issued ahead of use (0: none); ``"auto"``: picked by the cost model."""
    prefetch_bytes: int | None = None
    """Cap on bytes gathered but not yet used (``None``: only ``prefetch`` bounds it)."""
    reduce_scatter_bytes: int | str | None = "auto"
    """Cap on reduce-scatter input bytes in flight; ``"auto"``: one unit's, or picked by the cost model
    when ``hardware`` is named; ``None``: no cap."""
    inductor: bool = True
    """``False`` runs the scheduled FX graphs without Inductor (for debugging)."""
    elide_single_rank: bool = True
    """``False`` keeps the collectives of one-rank groups (for measuring their cost)."""
    inplace_gather: bool = True
    """``False`` packs each all-gather bucket into a buffer of its own, not its slice of the output
    (NOTE [in-place all-gather])."""
    bucket_alone_bytes: int | None = 16 << 20
    """A parameter at least this large (full size, bytes) keeps its own all-gather and reduce-scatter
    (NOTE [large params alone]); ``None`` buckets every parameter."""
    check_agreement: bool = True
    """Compare each compiled graph's collective sequence with every peer rank's before it runs
    (NOTE [agreement]), and notice ranks that run different graphs (NOTE [lockstep])."""
    agreement_timeout_s: float | None = None
    """Seconds to wait for a live peer in the agreement check (``None``: the process group's timeout)."""
    dump_dir: str | os.PathLike[str] | None = None
    """Write each compiled graph's schedule (table, Chrome trace, timeline) there, per graph and rank."""
    hardware: str | None = None
    """A preset of ``cost.HARDWARE`` for the cost model (default: this device's)."""
    calibration: str | os.PathLike[str] | None = None
    """A JSON of measured numbers for the cost model."""
    disabled_passes: Sequence[str] = ()
    """Passes switched off by name (``PASS_NAMES``); a later pass that needs one's work fails."""
    log_pass_diffs: bool = False
    """Log each pass's diff."""
    outline: bool = True
    """``True``: repeated blocks are compiled as one body per kind, called once per unit
    (NOTE [outlined units]); ``False``: every block inline. Not applied where the cost model picks settings."""

    def __post_init__(self) -> None:
        for name in ("dump_dir", "calibration"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        object.__setattr__(self, "disabled_passes", tuple(self.disabled_passes))
        if self.schedule not in SCHEDULES:
            raise ValueError(f"make_backend: schedule={self.schedule!r}; use one of {SCHEDULES}")
        prefetch = self.prefetch
        if prefetch != "auto" and (not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0):
            raise ValueError(f"make_backend: prefetch={prefetch!r}; use an int >= 0 (units gathered ahead) or 'auto'")
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
            raise ValueError(f"make_backend: disabled_passes {sorted(unknown)} match no pass; "
                             f"known: {list(PASS_NAMES)}")

    def uses_cost_model(self) -> bool:
        """Whether a schedule setting is picked by the cost model."""
        return self.prefetch == "auto" or (self.reduce_scatter_bytes == "auto" and self.hardware is not None)

    def outlines(self) -> bool:
        """Keep outlined bodies, except where the cost model, which cannot see inside them, picks settings."""
        return self.outline and not self.uses_cost_model()

    def cost_model(self) -> Hardware:
        """The hardware model: the named preset, else this device's."""
        if self.hardware is None and self.calibration is None:
            return detect_hardware()
        return load_hardware(self.hardware or detect_hardware(), self.calibration)


@dataclass(frozen=True)
class Context:
    """What one compile's passes are bound to."""

    options: BackendOptions
    example_inputs: Sequence[Any] = ()
    choice: Choice | None = None
    pieces: Mapping[str, Sequence[Piece]] = field(default_factory=dict)

    def chosen(self) -> Choice:
        assert self.choice is not None, "the scheduling stage runs once the settings are chosen"
        return self.choice

    def rank_of(self) -> Callable[[str], int] | None:
        """This rank's index in a group, for the in-place all-gather (``None``: out of place)."""
        return (lambda group: resolve_group(group).rank()) if self.options.inplace_gather else None


Stage = tuple[tuple[str, Callable[[Context], GraphPass]], ...]
_partial = functools.partial

INPUTS: Stage = (("split_flat_inputs", lambda c: _partial(split_flat_inputs_pass, pieces=c.pieces)),)
CAPTURE: Stage = (
    ("outline", lambda c: _partial(outline_blocks_pass, is_block=is_outline_candidate)),  # NOTE [outlining by proof]
    ("unroll", lambda c: unroll_scans_pass),  # NOTE [unrolled stacks]
    ("hoist", lambda c: hoist_unshards_pass),  # NOTE [hoisting markers]
    ("inline", lambda c: _partial(inline_subgraphs_pass, keep=worth_a_call if c.options.outlines() else lambda b: False,
                                  min_calls=2)),  # a body called once saves nothing
    ("inline_nested", lambda c: inline_nested_pass),
    ("name_markers", lambda c: _partial(name_markers, example_inputs=c.example_inputs)),  # NOTE [outlined units]
)
GROUPING: Stage = (("group_markers", lambda c: group_markers_pass),)  # NOTE [flat markers]
LOWERING: Stage = (
    ("share", lambda c: _partial(share_subgraphs_pass, recompile=False)),
    ("lower", lambda c: _partial(lower_markers_pass, elide_single_rank=c.options.elide_single_rank,
                                 rank_of=c.rank_of(), alone_bytes=c.options.bucket_alone_bytes)),  # NOTE [one lowering]
)
SCHEDULING: Stage = (
    ("prefetch", lambda c: _partial(prefetch_pass, depth=c.chosen().prefetch, max_bytes=c.options.prefetch_bytes)),
    ("reduce_scatter", lambda c: _partial(reduce_scatter_pass, schedule=c.options.schedule,
                                          max_bytes=c.chosen().reduce_scatter_bytes)),
    ("streams", lambda c: streams_pass),  # NOTE [streams]
    ("absorb", lambda c: absorb_copies_pass),  # NOTE [copies inside bodies]
)
FALLBACK: Stage = (("inline_all", lambda c: inline_subgraphs_pass),)  # NOTE [outlining by proof]
STAGES = (INPUTS, CAPTURE, GROUPING, LOWERING, SCHEDULING, FALLBACK)
PASS_NAMES = tuple(name for stage in STAGES for name, _ in stage)


def run_stage(gm: fx.GraphModule, stage: Stage, context: Context, *, recompile: bool = True) -> fx.GraphModule:
    """``stage``'s passes, bound to ``context``; ``recompile=False`` leaves the recompile to the next stage."""
    options = context.options
    disabled = set(options.disabled_passes)
    if not options.outlines():
        disabled.add("outline")
    passes = [NamedPass(name, build(context)) for name, build in stage]
    return run_passes(gm, passes, disabled=disabled, log_diff=options.log_pass_diffs, allow_unknown=True,
                      recompile=recompile)


def scheduler(options: BackendOptions) -> Callable[[fx.GraphModule, Choice], fx.GraphModule]:
    """The scheduling stage under ``options``, for settings the cost model tries."""
    return lambda gm, choice: run_stage(gm, SCHEDULING, Context(options, choice=choice))
