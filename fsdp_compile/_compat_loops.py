"""The private torch APIs behind a stack's loop (NOTE [stacked blocks] in ``stack.py``), in one place.

``_compat.py``'s rule holds here too: where these move between releases, the fallback belongs here
and nowhere else. Checked on torch 2.13 (CPU, CI) and 2.11 (the H200 machine's CUDA build, and the
same wheel on the CPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._higher_order_ops.scan import scan

# Both loop workarounds below are for torch 2.11 (fixed in 2.13).
_BEFORE_2_13 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)

__all__ = [
    "CACHEABLE_LOOPS",
    "SCAN_FAKE_LEAKS_BODY_SYMBOLS",
    "SCAN_NEEDS_FIRST_CARRY_GRAD",
    "host_loop_counters",
    "loop_backwards_in_place",
    "loop_countdown",
    "rewrite_loop_counters",
    "scan",
    "tagging_loop_bodies",
]


# pytorch/pytorch#184528: a scan whose first carry does not require grad drops the carry's gradient
# (every block but the last then gets a wrong weight gradient), fixed by pytorch/pytorch#185332, which is
# in 2.13 and not in 2.11 (``benchmarks/scan_markers.py``). Where this is set, a stack makes its carry
# require grad first.
SCAN_NEEDS_FIRST_CARRY_GRAD = _BEFORE_2_13


@contextlib.contextmanager
def tagging_loop_bodies(tag: Callable[[Any], None]) -> Iterator[None]:
    """Within the context, ``tag(joint)`` runs on each loop body's joint graph just before torch
    partitions it into the body's forward and backward (``HopJointGraph.partition``, torch 2.11 and
    2.13): there, must-recompute tags decide what the loop's forward keeps for its backward, as
    ``partition.py``'s tags do for the outer joint graph."""
    from torch._higher_order_ops.partitioner import HopJointGraph

    original = HopJointGraph.partition

    def tag_then_partition(self: Any, *args: Any, **kwargs: Any) -> Any:
        tag(self.joint_gm)
        return original(self, *args, **kwargs)

    HopJointGraph.partition = tag_then_partition
    try:
        yield
    finally:
        HopJointGraph.partition = original


# NOTE [loop counters off the C++ path]: Inductor lowers a scan to a ``while_loop`` whose counter lives
# on the host (``decompose_scan_to_while_loop`` in its post-grad passes: a zero, a compare with the
# length, an add of one), so a GPU model's loop compiles scalar C++ kernels, and before a process's first
# C++ build Inductor probes the CPU's vector instructions and builds a precompiled header: on the H200
# (torch 2.11) a 4-block scan compiled in 58-75 s with that and 12-13 s without (README, Compile time,
# ``benchmarks/scan_probe.py``). ``host_loop_counters`` swaps the three ops, after torch's decomposition,
# for ops of ours that Inductor calls as they are (no C++ at all).
_LOOP_COUNTER_OPS: list[Any] = []


def _loop_counter_ops() -> list[Any]:
    """``fsdp_loop::start``, ``below`` and ``next``, the counter's swaps; ``fsdp_loop::countdown``, a
    backward loop's block numbers, is registered with them (all when this module is imported: code that
    a warm start loads from Inductor's cache calls them)."""
    if _LOOP_COUNTER_OPS:
        return _LOOP_COUNTER_OPS

    @torch.library.custom_op("fsdp_loop::start", mutates_args=(), schema="(Tensor like) -> Tensor")
    def start(like: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), dtype=torch.int64)

    @torch.library.custom_op("fsdp_loop::below", mutates_args=(), schema="(Tensor i, int n) -> Tensor")
    def below(i: torch.Tensor, n: int) -> torch.Tensor:
        return i < n

    @torch.library.custom_op("fsdp_loop::next", mutates_args=(), schema="(Tensor i) -> Tensor")
    def step(i: torch.Tensor) -> torch.Tensor:
        return i + 1

    for op, dtype in ((start, torch.int64), (below, torch.bool), (step, torch.int64)):
        op.register_fake(lambda *args, dtype=dtype: torch.empty((), dtype=dtype, device="cpu"))

    @torch.library.custom_op("fsdp_loop::countdown", mutates_args=(), schema="(Tensor like, int n) -> Tensor")
    def countdown(like: torch.Tensor, n: int) -> torch.Tensor:
        return torch.arange(n - 1, -1, -1, dtype=torch.int64)

    countdown.register_fake(lambda like, n: torch.empty((n,), dtype=torch.int64, device="cpu"))
    ops = torch.ops.fsdp_loop
    _LOOP_COUNTER_OPS.extend([ops.start.default, ops.below.default, ops.next.default])
    return _LOOP_COUNTER_OPS


_loop_counter_ops()


def loop_countdown(like: torch.Tensor, n: int) -> torch.Tensor:
    """``n - 1, ..., 0`` as a CPU int64 tensor, through ``fsdp_loop::countdown`` (an op that Inductor
    calls as it is, so no C++ is compiled for it: NOTE [loop counters off the C++ path])."""
    return torch.ops.fsdp_loop.countdown.default(like, n)


@contextlib.contextmanager
def loop_backwards_in_place(backward: Callable[..., Any]) -> Iterator[None]:
    """Within the context, a scan's backward is ``backward(impl, *grads)`` instead of torch's
    ``ScanAutogradImpl.call_backward`` (same signature in torch 2.11 and 2.13): NOTE [a loop's backward
    in place] in ``loop_backward.py``. Its ``.item()`` of the block number needs a fake mode that allows
    scalar outputs, as the decomposition of a loop does (:func:`host_loop_counters`)."""
    from torch._higher_order_ops.scan import ScanAutogradImpl

    original = ScanAutogradImpl.call_backward

    def call_backward(self: Any, *grads: Any) -> Any:
        with _scalar_outputs(torch._guards.detect_fake_mode()):
            return backward(self, *grads)

    ScanAutogradImpl.call_backward = call_backward
    try:
        with _body_symbols_stay_inside():
            yield
    finally:
        ScanAutogradImpl.call_backward = original


# NOTE [caching loops]: torch marks ``scan`` and ``while_loop`` uncacheable, so a graph holding a stack's
# loop would compile afresh at every process start. Their bodies are graph modules of the graph being
# keyed, hashed with it as ``invoke_subgraph`` bodies are (which torch does cache), so the backend marks
# the two cacheable while it compiles, keyed by the torch version (``tests/test_warm_start.py``).
CACHEABLE_LOOPS = {"unsafe_marked_cacheable_functions": {
    "torch.ops.higher_order.scan": torch.__version__, "torch.ops.higher_order.while_loop": torch.__version__}}


def _host_scalar(node: Any) -> bool:
    val = node.meta.get("val")
    return (node.op == "call_function" and isinstance(val, torch.Tensor) and val.dim() == 0
            and val.device.type == "cpu" and val.dtype in (torch.int64, torch.bool))


def rewrite_loop_counters(gm: Any) -> None:
    """A decomposed loop's host counter (``aten.full([], 0)``, ``lt.Scalar``, ``add(i, 1)``) as our
    ops, in ``gm`` and the loop bodies it holds (NOTE [loop counters off the C++ path])."""
    start, below, step = _loop_counter_ops()
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and isinstance(getattr(gm, str(node.target), None), torch.fx.GraphModule):
            rewrite_loop_counters(getattr(gm, str(node.target)))
        if not _host_scalar(node):
            continue
        if node.target is aten.full.default and node.args[1] == 0 and node.meta["val"].dtype == torch.int64:
            like = next(iter(gm.graph.find_nodes(op="placeholder")), None)
            if like is not None:  # any input: the op needs one tensor argument, and ignores it
                node.target, node.args, node.kwargs = start, (like,), {}
        elif node.target is aten.lt.Scalar and isinstance(node.args[1], int):
            node.target, node.kwargs = below, {}
        elif node.target is aten.add.Tensor and node.args[1] == 1:
            node.target, node.args, node.kwargs = step, (node.args[0],), {}
    gm.recompile()


@contextlib.contextmanager
def host_loop_counters(example_inputs: Any = ()) -> Iterator[None]:
    """Within the context, Inductor's scan decomposition runs whether Dynamo traced the whole graph or
    not, and is followed by :func:`rewrite_loop_counters` (NOTE [loop counters off the C++ path]).
    The decomposition reads the counter with ``.item()`` while tracing the loop body, and a stack's
    backward loop reads its block number so (NOTE [a loop's backward in place]) wherever Inductor runs
    the loop on fake tensors; a fake mode allows that only where Dynamo traced with ``fullgraph=True``
    (its shape environment's ``allow_scalar_outputs``) or the mode itself says so. The fake mode of
    ``example_inputs`` says so for the whole context, and any other for the decomposition."""
    import torch._inductor.fx_passes.post_grad as post_grad

    decompose = post_grad.decompose_scan_to_while_loop

    def decompose_then_rewrite(gm: Any) -> None:
        with _scalar_outputs(torch._guards.detect_fake_mode()):
            decompose(gm)
        rewrite_loop_counters(gm)

    post_grad.decompose_scan_to_while_loop = decompose_then_rewrite
    try:
        with _scalar_outputs(torch._guards.detect_fake_mode(list(example_inputs))), _body_symbols_stay_inside():
            yield
    finally:
        post_grad.decompose_scan_to_while_loop = decompose


# Torch 2.11 runs a scan's body on fake tensors (its fake kernel) so that a symbol made by an ``.item()``
# in the body, such as a backward loop's block number (NOTE [a loop's backward in place]), counts as
# made by the scan and must then be among its outputs' shapes ("Pending unbacked symbols {u3} not in
# returned outputs", in Inductor's fake propagation). 2.13 keeps such symbols inside the body.
SCAN_FAKE_LEAKS_BODY_SYMBOLS = _BEFORE_2_13


@contextlib.contextmanager
def _body_symbols_stay_inside() -> Iterator[None]:
    """Within the context, on torch 2.11, a scan's fake kernel runs its body with the shape
    environment ignoring the symbols the body makes (:data:`SCAN_FAKE_LEAKS_BODY_SYMBOLS`)."""
    if not SCAN_FAKE_LEAKS_BODY_SYMBOLS:
        yield
        return
    from torch._higher_order_ops.scan import scan_op
    from torch._subclasses.fake_tensor import FakeTensorMode

    original = scan_op.python_key_table[FakeTensorMode]

    def fake_scan(mode: Any, *args: Any) -> Any:
        quiet = mode.shape_env.ignore_fresh_unbacked_symbols() if mode.shape_env else contextlib.nullcontext()
        with quiet:
            return original(mode, *args)

    scan_op.python_key_table[FakeTensorMode] = fake_scan
    try:
        yield
    finally:
        scan_op.python_key_table[FakeTensorMode] = original


@contextlib.contextmanager
def _scalar_outputs(mode: Any) -> Iterator[None]:
    """Within the context, fake ``mode`` (if any) lets ``.item()`` make an unbacked symbol."""
    allowed = getattr(mode, "allow_scalar_outputs", None)
    if allowed is not None:
        mode.allow_scalar_outputs = True
    try:
        yield
    finally:
        if allowed is not None:
            mode.allow_scalar_outputs = allowed
