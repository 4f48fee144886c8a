"""Every private torch API fsdp-compile uses, in one place (supported: torch >= 2.11).

Where these move between releases, the fallback belongs here and nowhere else. Checked on torch 2.13
(CPU, CI) and 2.11 (CUDA, the H200 machine).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._functorch.aot_autograd import make_boxed_func
from torch._higher_order_ops.scan import scan
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.compile_fx import compile_fx_inner
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.output_code import OutputCode
from torch._logging._internal import getArtifactLogger

__all__ = [
    "aot_autograd",
    "compile_fx_inner",
    "compile_region",
    "compile_time_metrics",
    "default_store",
    "forward_user_outputs",
    "group_timeout_s",
    "getArtifactLogger",
    "inductor_config_patch",
    "inductor_joint_graph_passes",
    "inductor_pre_grad_passes",
    "keep_output_strides",
    "lowering_outlined_bodies",
    "make_boxed_func",
    "min_cut_rematerialization_partition",
    "queue_end_of_backward",
    "CACHEABLE_LOOPS",
    "SCAN_NEEDS_FIRST_CARRY_GRAD",
    "host_loop_counters",
    "region_schemas_once",
    "rewrite_loop_counters",
    "scan",
    "tagging_loop_bodies",
    "register_foreach_type",
    "resolve_group",
    "select_decomp_table",
    "serializable",
    "store_connection",
    "timed",
    "traced_for",
]


def resolve_group(name: str) -> dist.ProcessGroup:
    """The process group called ``name`` (functional collectives name groups by string)."""
    return dist.distributed_c10d._resolve_process_group(name)


def default_store() -> dist.Store:
    """The key-value store the default process group was initialised with."""
    return dist.distributed_c10d._get_default_store()


def store_connection(store: dist.Store) -> dist.Store:
    """A second client connection to ``store`` (for a background thread), or ``store`` itself where
    the store cannot be cloned."""
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    try:
        return clone()
    except RuntimeError:  # a store type without clone support
        return store


def group_timeout_s(group: dist.ProcessGroup) -> float:
    """The timeout, in seconds, that ``group``'s collectives run under (``init_process_group(timeout=)``
    or ``new_group(timeout=)``; the backend's default when none was given)."""
    backend = dist.get_backend(group)
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    try:
        return float(group._get_backend(device).options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return float(dist.distributed_c10d._get_default_timeout(backend).total_seconds())


def register_foreach_type(cls: type) -> None:
    """Let ``torch.nn.utils.clip_grad_norm_`` and friends take their foreach path for tensors of type
    ``cls`` (torch registers ``DTensor`` the same way)."""
    from torch.utils import _foreach_utils

    if cls not in _foreach_utils._foreach_supported_types:
        _foreach_utils._foreach_supported_types.append(cls)


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the autograd engine finishes the current backward pass."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]


def serializable(compiler: Callable[..., Any]) -> Callable[..., Any]:
    """``compiler`` marked as returning Inductor's output code, which AOTAutograd's cache can save and
    load (NOTE [warm start] in ``cache.py``): its results must carry their graph-cache key."""
    return SerializableAOTDispatchCompiler(OutputCode, compiler)


def inductor_config_patch(changes: dict[str, Any]) -> Any:
    """A context manager applying Inductor config ``changes`` for one compile only."""
    return torch._inductor.config.patch(changes)


def _on_meta(inputs: Any) -> bool:
    # Inductor's graph passes fold meta-device computations away entirely (nothing is computed on
    # meta): ``explain`` traces on meta and must keep the graph as written.
    leaves = torch.utils._pytree.tree_leaves(inputs)
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in leaves)


def inductor_pre_grad_passes(gm: Any, example_inputs: Any) -> Any:
    """Inductor's pre-grad passes on a Dynamo graph, as ``torch.compile``'s Inductor runs them."""
    from torch._inductor import compile_fx as _fx

    if _on_meta(example_inputs):
        return gm
    if hasattr(_fx, "_recursive_pre_grad_passes"):
        return _fx._recursive_pre_grad_passes(gm, example_inputs)
    return _fx.pre_grad_passes(gm, example_inputs)  # type: ignore[attr-defined]


def inductor_joint_graph_passes(joint: Any, joint_inputs: Any) -> Any:
    """Inductor's joint-graph passes (before partitioning), as its own partition function runs them."""
    from torch._inductor import compile_fx as _fx
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes

    if _on_meta(joint_inputs):
        return joint
    devices = [t.device for t in torch.utils._pytree.tree_leaves(joint_inputs) if isinstance(t, torch.Tensor)]
    device = devices[0] if devices else None
    recursive = getattr(_fx, "_recursive_joint_graph_passes", None)
    if recursive is not None:
        try:
            return recursive(joint, skip_invoke_subgraph=True, input_device=device)
        except TypeError:  # older signature
            return recursive(joint)
    return joint_graph_passes(joint)


def timed(key: str) -> Any:
    """A context manager adding its duration to torch.compile's timing table under ``key`` (it shows in
    ``torch._dynamo.utils.compile_times()``, tlparse and :func:`compile_time_metrics`)."""
    from torch._dynamo.utils import dynamo_timed

    return dynamo_timed(key)


def compile_time_metrics() -> dict[str, float]:
    """Seconds spent so far in this process under each ``dynamo_timed`` key (Dynamo, AOTAutograd,
    Inductor and :func:`timed`), summed over compiles."""
    from torch._dynamo.utils import compilation_time_metrics

    return {key: float(sum(values)) for key, values in compilation_time_metrics.items()}


# More traces of one region than a model has units; past torch's cap (8 in 2.13) Dynamo raises instead
# of tracing a block whose guards differ (a per-block attribute its forward reads, say) once more.
_REGION_TRACES = 1 << 20


def compile_region(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a ``torch.compiler.nested_compile_region``: traced once by Dynamo and called as one
    ``invoke_subgraph`` per call, again traced only where a call's guards differ; a no-op eagerly."""
    try:
        return torch.compiler.nested_compile_region(fn, max_reuse_entries=_REGION_TRACES)
    except TypeError:  # torch 2.11: no cap, no reuse of traces (every call is traced, equal graphs shared)
        return torch.compiler.nested_compile_region(fn)


@contextlib.contextmanager
def region_schemas_once() -> Iterator[None]:
    """Within the context, each ``invoke_subgraph`` body derives its schema once, not once per call.

    Under autograd, torch checks every call of a body for input mutation by tracing the body again
    (``HigherOrderOperator.py_autograd_impl -> gen_schema``, torch 2.11 and 2.13): for a model of N
    identical outlined blocks, N traces of the block during AOTAutograd where one answers. The schema
    depends only on the body, so calls of one body (by identifier and graph) reuse the first answer.
    """
    hop_type = type(torch.ops.higher_order.invoke_subgraph)
    original = hop_type.gen_schema
    answers: dict[tuple[object, int], Any] = {}

    def gen_schema(self: Any, subgraph: Any, identifier: Any, *operands: Any) -> Any:
        graph = getattr(subgraph, "subgraph", subgraph)  # a FunctionalizeCtxWrapper holds the graph
        key = (identifier, id(graph))
        if key not in answers:
            answers[key] = (original(self, subgraph, identifier, *operands), graph)  # keeps graph alive
        return answers[key][0]

    hop_type.gen_schema = gen_schema
    try:
        yield
    finally:
        hop_type.gen_schema = original


@contextlib.contextmanager
def lowering_outlined_bodies() -> Iterator[None]:
    """Within the context, Inductor never reuses an ``invoke_subgraph`` body's inputs in place, and does
    not re-check their sizes at every call.

    NOTE [donated subgraph inputs]: a backward graph's saved tensors may be *donated*: Inductor reuses
    their memory once their last use is done (``bw_donated_idxs``, placeholder positions of the
    backward graph). A body lowered inside that backward (``SubgraphLowering``) inherits the list and
    applies it to its *own* placeholder positions (torch 2.11 and 2.13): an input of the body at a
    position the outer graph donates is then overwritten in place, even when the outer graph reads it
    (or an alias the body returns) after the call. Seen as wrong gradients from an outlined block at 2
    ranks: the body wrote its result into its incoming gradient buffer and returned it, and the outer
    graph reused that buffer at once. A body's inputs belong to the graph that calls it, so none is
    donated; the outer graph keeps its own donations.

    NOTE [body input checks]: Inductor's generated code checks each graph input's size and stride once
    per call (``assert_size_stride``). For a body those inputs come from the calling graph, whose
    buffers Inductor laid out itself and constrained to the body's layouts: the checks are 40 host calls
    per block and step that can only pass. The calling graph keeps its own.
    """
    from torch._inductor.codegen.wrapper import SubgraphPythonWrapperCodegen
    from torch._inductor.graph import SubgraphLowering

    original_init = SubgraphLowering.__init__
    original_asserts = SubgraphPythonWrapperCodegen.codegen_input_size_and_nan_asserts

    def __init__(self: Any, parent: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, parent, *args, **kwargs)
        self.bw_donated_idxs = None

    SubgraphLowering.__init__ = __init__
    SubgraphPythonWrapperCodegen.codegen_input_size_and_nan_asserts = lambda self: None
    try:
        yield
    finally:
        SubgraphLowering.__init__ = original_init
        SubgraphPythonWrapperCodegen.codegen_input_size_and_nan_asserts = original_asserts


def keep_output_strides(gm: Any, user_outputs: range | None) -> None:
    """Mark the outputs of ``gm`` that Inductor must return in their traced strides: ``user_outputs``
    (positions in the flattened output tuple; ``None``: every output), and every output of each
    ``invoke_subgraph`` body inside it, whose caller was traced against those strides.

    NOTE [output strides]: Inductor pads the row stride of buffers on CUDA (``comprehensive_padding``:
    a bf16 [4096, 10928] matmul result gets stride 10944) unless the buffer is a *user-visible* output,
    which keeps the strides the graph was traced with. ``compile_fx``'s own forward and backward
    compilers say which outputs those are (the output node's ``user_visible_output_idxs``: a
    backward's gradients, a forward's model outputs, a body's results); ``compile_fx_inner``, which the
    backend calls, does not. Unmarked, the gradient of such a weight left the backward padded, and
    autograd's ``AccumulateGrad`` copied it into the parameter's layout on every step (a strided
    4096 x 10928 copy per block, 0.11 ms each, on the H200). Saved activations stay unmarked: padding
    them is Inductor's choice, as under ``compile_fx``.
    """
    from torch.utils import _pytree as pytree

    (out,) = gm.graph.find_nodes(op="output")
    leaves = pytree.arg_tree_leaves(*out.args)
    positions = range(len(leaves)) if user_outputs is None else user_outputs
    out.meta["user_visible_output_idxs"] = [i for i in positions
                                            if i < len(leaves) and isinstance(leaves[i], torch.fx.Node)]
    for call in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        keep_output_strides(getattr(gm, call.args[0].target), None)


def forward_user_outputs() -> range | None:
    """Positions of the model's own outputs in the forward graph AOTAutograd is compiling now (after
    the mutated inputs it returns first), or ``None`` where it says nothing."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is None:
        return None
    start = meta.num_mutated_inp_runtime_indices
    return range(start, start + meta.num_outputs)


def traced_for() -> Any:
    """The backend that the graph Dynamo is tracing right now will be handed to, unwrapped (``None``
    outside a trace). Called through :func:`torch._dynamo.assume_constant_result`, Dynamo runs it while
    tracing and keeps its answer as a constant of the graph."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = getattr(InstructionTranslator, "current_tx", lambda: None)()
    fn = getattr(getattr(tx, "output", None), "compiler_fn", None)
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        inner = (getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "__wrapped__", None)
                 or getattr(fn, "compiler_fn", None))
        if inner is None:
            return fn
        fn = inner
    return fn


# --- Loops over stacked blocks (NOTE [stacked blocks] in stack.py) ---


# pytorch/pytorch#184528: a scan whose first carry does not require grad drops the carry's gradient
# (every block but the last then gets a wrong weight gradient), fixed by pytorch/pytorch#185332, which is
# in 2.13 and not in 2.11 (``benchmarks/scan_markers.py``). Where this is set, a stack makes its carry
# require grad first.
SCAN_NEEDS_FIRST_CARRY_GRAD = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


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
    """``fsdp_loop::start``, ``below`` and ``next`` (registered when this module is imported: code that
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
    _LOOP_COUNTER_OPS.extend([ops.start.default, ops.below.default, ops.next.default, ops.countdown.default])
    return _LOOP_COUNTER_OPS


_loop_counter_ops()


def loop_countdown(like: torch.Tensor, n: int) -> torch.Tensor:
    """``n - 1, ..., 0`` as a CPU int64 tensor, through ``fsdp_loop::countdown`` (an op that Inductor
    calls as it is, so no C++ is compiled for it: NOTE [loop counters off the C++ path])."""
    return _loop_counter_ops()[3](like, n)


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
    start, below, step, _ = _loop_counter_ops()
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
SCAN_FAKE_LEAKS_BODY_SYMBOLS = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


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
