"""Every private torch API fsdp-compile uses, in one place (supported: torch >= 2.11); fallbacks for
names that move between releases belong here."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch._logging
from torch._C import DisableTorchFunctionSubclass
from torch._dynamo import assume_constant_result
from torch._dynamo.backends.common import aot_autograd
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._higher_order_ops.scan import scan
from torch._inductor.compile_fx import compile_fx_inner
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.output_code import OutputCode
from torch._logging import _internal as _logging_internal
from torch._ops import OpOverload

__all__ = [
    "aot_autograd", "assume_constant_result", "compile_fx_inner", "compile_time_metrics", "default_store",
    "DisableTorchFunctionSubclass", "donate_no_saved_tensors", "forward_user_outputs", "group_timeout_s",
    "inductor_config_patch", "inductor_joint_graph_passes", "inductor_pre_grad_passes", "keep_output_strides",
    "lowering_outlined_bodies", "make_boxed_func", "min_cut_rematerialization_partition", "OpOverload",
    "print_native_stacks_on_fatal_signal", "queue_end_of_backward", "region_schemas_once",
    "register_collective_work", "register_foreach_type", "resolve_group", "restarts_the_trace", "scan",
    "scan_example_values_without_autograd", "select_decomp_table", "serial_gloo", "serializable",
    "store_connection", "structured_trace_on", "timed", "trace_structured_artifact", "traced_for",
]


def resolve_group(name: str) -> dist.ProcessGroup:
    """The process group called ``name`` (functional collectives name groups by string)."""
    return dist.distributed_c10d._resolve_process_group(name)


def register_collective_work(tensor: torch.Tensor, work: dist.Work) -> None:
    """Let ``wait_tensor(tensor)`` wait on ``work``, as torch's own functional collectives do."""
    torch._C._distributed_c10d._register_work(tensor, work)


class PythonGroupDevices:
    """For a process group written in Python: torch's queries of a group's C++ backends, answered."""

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cuda" if torch.cuda.is_available() else "cpu")]

    def _get_backend(self, device: torch.device) -> _NoCppBackend:
        return _NoCppBackend(f"{type(self).__name__} has no C++ backend for {device}")


class _NoCppBackend:
    """A Python group's answer to ``_get_backend``: no time estimate, and any other use is an error."""

    supports_time_estimate = False

    def __init__(self, why: str) -> None:
        self._why = why

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"{self._why} (asked for {name!r})")


def print_native_stacks_on_fatal_signal() -> None:
    """On a fatal signal, print every thread's native stack (where torch can); Ctrl-C stays Python's."""
    setter = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
    if setter is not None:
        interrupt = signal.getsignal(signal.SIGINT)
        setter(True)
        if interrupt is not None:
            signal.signal(signal.SIGINT, interrupt)


def default_store() -> dist.Store:
    """The key-value store the default process group was initialised with."""
    return dist.distributed_c10d._get_default_store()


def store_connection(store: dist.Store) -> dist.Store:
    """A second client connection to ``store``, or ``store`` itself where it cannot be cloned."""
    clone = getattr(store, "clone", None)
    try:
        return store if clone is None else clone()
    except RuntimeError:  # a store type without clone support
        return store


def group_timeout_s(group: dist.ProcessGroup) -> float:
    """The timeout, in seconds, of ``group``'s collectives (the backend's default when none was given)."""
    backend = dist.get_backend(group)
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    try:
        return float(group._get_backend(device).options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return float(dist.distributed_c10d._get_default_timeout(backend).total_seconds())


SERIAL_GLOO = "gloo_serial"


def serial_gloo() -> str:
    """The name of gloo with one thread per group, registered on first use (NOTE [one gloo thread per group])."""
    if SERIAL_GLOO not in dist.Backend.backend_list:
        def create(store: dist.Store, rank: int, size: int, timeout: Any) -> dist.ProcessGroupGloo:
            options = dist.ProcessGroupGloo._Options()
            options._timeout, options._threads = timeout, 1
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
            return dist.ProcessGroupGloo(store, rank, size, options)
        dist.Backend.register_backend(SERIAL_GLOO, create, devices=["cpu"])
    return SERIAL_GLOO


def register_foreach_type(cls: type) -> None:
    """Let ``clip_grad_norm_`` and friends take their foreach path for tensors of type ``cls``."""
    from torch.utils import _foreach_utils
    if cls not in _foreach_utils._foreach_supported_types:
        _foreach_utils._foreach_supported_types.append(cls)


def queue_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the autograd engine finishes the current backward pass."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]


def serializable(compiler: Callable[..., Any]) -> Callable[..., Any]:
    """``compiler`` marked as returning Inductor's output code, which AOTAutograd's cache saves."""
    return SerializableAOTDispatchCompiler(OutputCode, compiler)


def on_each_compile(start: Callable[[Any], None], end: Callable[[Any], None]) -> None:
    """Call ``start`` and ``end`` around each outermost Dynamo compile (idempotent; a reset forgets them)."""
    handler = torch._dynamo.callback_handler
    if start not in handler.start_callbacks:
        handler.register_start_callback(start)
    if end not in handler.end_callbacks:
        handler.register_end_callback(end)


def in_frame_compile() -> bool:
    """Whether Dynamo is compiling a frame now."""
    return torch._guards.CompileContext.current_compile_id() is not None


def inductor_config_patch(changes: dict[str, Any]) -> Any:
    """A context manager applying Inductor config ``changes`` for one compile only."""
    return torch._inductor.config.patch(changes)


def _on_meta(inputs: Any) -> bool:
    """Whether a tensor of ``inputs`` is on meta: Inductor's passes would fold the graph away there."""
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
    """A context manager adding its duration to torch.compile's timing table under ``key``."""
    from torch._dynamo.utils import dynamo_timed
    return dynamo_timed(key)


def compile_time_metrics() -> dict[str, float]:
    """Seconds spent so far in this process under each ``dynamo_timed`` key, summed over compiles."""
    from torch._dynamo.utils import compilation_time_metrics
    return {key: float(sum(values)) for key, values in compilation_time_metrics.items()}


@contextlib.contextmanager
def region_schemas_once() -> Iterator[None]:
    """Within the context, each ``invoke_subgraph`` body derives its schema once, not once per call:
    under autograd torch re-traces the body at every call to check for input mutation, and the schema
    depends only on the body."""
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

    NOTE [donated subgraph inputs]: a body lowered inside a backward (``SubgraphLowering``) inherits the
    backward's ``bw_donated_idxs`` and applies them to its *own* placeholder positions, so it may
    overwrite an input that the outer graph still reads (seen as wrong gradients). A body's inputs
    belong to the calling graph, so none is donated; the outer graph keeps its own donations.

    NOTE [body input checks]: a body's inputs come from the calling graph, whose buffers Inductor laid
    out to the body's layouts, so the per-call ``assert_size_stride`` checks can only pass; they are
    dropped for bodies only.
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
    (positions in the flattened outputs; ``None``: all), and every output of each body it calls.

    NOTE [output strides]: Inductor pads the row stride of buffers on CUDA (``comprehensive_padding``)
    unless the buffer is a *user-visible* output (the output node's ``user_visible_output_idxs``).
    ``compile_fx``'s own compilers mark those; ``compile_fx_inner``, which the backend calls, does not.
    Unmarked, a weight's gradient leaves the backward padded, and ``AccumulateGrad`` copies it into the
    parameter's layout every step (docs/performance.md). Saved activations stay unmarked, as under
    ``compile_fx``.
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
    """Positions of the model's outputs in the forward graph AOTAutograd is compiling now, or ``None``."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is None:
        return None
    start = meta.num_mutated_inp_runtime_indices
    return range(start, start + meta.num_outputs)


def donate_no_saved_tensors() -> None:
    """From a forward compiler: the backward compiled with this forward donates none of its saved
    tensors (nothing to do outside a compile).

    NOTE [no donated buffers]: AOTAutograd marks saved tensors that alias no input or output as
    *donated* (``bw_donated_idxs``) and then refuses ``backward(retain_graph=True)`` wherever the
    backward was compiled before that call (an earlier plain ``backward()``, or a warm start). So that a
    graph may be kept at any step, the list is emptied here, on the tracing context's metadata that both
    the backward's compile and the runtime check read; the cache entry saves it empty. Inductor still
    frees each saved tensor after its last use; only writing a backward result into one is lost.
    """
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is not None:
        meta.bw_donated_idxs = []


def traced_for() -> Any:
    """The backend, unwrapped, that the graph Dynamo is tracing now is for (``None`` outside a trace)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator
    try:
        tx = getattr(InstructionTranslator, "current_tx", lambda: None)()
    except AttributeError:  # no Dynamo trace on this thread (yet)
        return None
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


def scan_example_values_without_autograd(is_ours: Callable[[], bool]) -> None:
    """NOTE [scan example values]: Dynamo gets a ``scan``'s output values (NOTE [stacked blocks]) by
    running it on fake tensors, through scan's autograd kernel when inputs require grad, which builds and
    partitions the body's joint graph only to return shapes. Our backend unrolls the scan before
    AOTAutograd, so that joint graph is never used. This wraps the kernel: while ``is_ours()`` and no
    graph is being traced (no proxy mode), the scan runs below autograd and its floating outputs require
    grad when an input does, as the autograd kernel's would. Anything else goes to torch's kernel.
    Installed once."""
    from torch._C import DispatchKey
    from torch._higher_order_ops.scan import scan_op
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    from torch.utils import _pytree as pytree

    original = scan_op.py_kernels.get(DispatchKey.Autograd)
    if original is None or getattr(original, "_fsdp_values_only", False):
        return

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if get_proxy_mode() is not None or not is_ours():
            return original(*args, **kwargs)
        with torch._C._AutoDispatchBelowAutograd():
            out = scan_op(*args, **kwargs)
        grads = torch.is_grad_enabled() and any(
            t.requires_grad for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        if grads:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                    t.requires_grad_(True)
        return out

    kernel._fsdp_values_only = True  # type: ignore[attr-defined]
    scan_op.py_kernels[DispatchKey.Autograd] = kernel
    scan_op._dispatch_cache.clear()


def restarts_the_trace(error: BaseException) -> bool:
    """Whether ``error`` is Dynamo asking to trace the frame again: it must reach Dynamo."""
    return isinstance(error, torch._dynamo.exc.RestartAnalysis)


def trace_structured_artifact(name: str, payload_fn: Callable[[], str]) -> None:
    """Write a string artifact to torch's structured trace; ``payload_fn`` runs only when the trace is on."""
    torch._logging.trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "string"},
                                    payload_fn=payload_fn)


def structured_trace_on() -> bool:
    """Whether this process writes torch's structured trace (``TORCH_TRACE=<dir>``)."""
    handler = getattr(_logging_internal, "LOG_TRACE_HANDLER", None)
    return (handler is not None and handler in _logging_internal.trace_log.handlers
            and getattr(handler, "root_dir", None) is not None)


def is_compiled_module(obj: object) -> bool:
    """Whether ``obj`` is ``torch.compile``'s wrapper of a module (its module is ``obj._orig_mod``)."""
    return isinstance(obj, torch._dynamo.eval_frame.OptimizedModule)


def tree_map_only(kind: type, fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to every leaf of ``tree`` that is a ``kind`` (torch's pytree), the rest kept."""
    return torch.utils._pytree.tree_map_only(kind, fn, tree)
