"""The emulated process group: this process is rank 0 of a world of N, and every collective is timed, not sent.

NOTE [emulated backend]: ``init_emulated_world(world)`` registers the backend ``"emulated"``
(``Backend.register_backend``) as the default process group, so every group made afterwards (``FsdpGroups``,
FSDP2's ``DeviceMesh``, SimpleFSDP's) is an :class:`EmulatedGroup` and every collective form reaches it, the
functional ``_out`` forms included; no caller is patched. A group is one communicator: one CUDA stream running
its collectives in order. A collective waits for the caller's stream, runs NOTE [emulated kernel] on the
group's stream and ``record_stream``s its tensors; ``Work.wait()`` makes the caller's stream wait for it. CPU
tensors are moved at once, untimed. Every rank's part holds rank 0's data, so losses are not a real run's.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fsdp_compile._compat import PythonGroupDevices, register_collective_work, resolve_group
from fsdp_compile.emulate.timing import EmulatedTopology
from fsdp_compile.inspection.hardware import Hardware, load_hardware
from fsdp_compile.inspection.topology import SHARED_LINKS

__all__ = ["BACKEND", "EmulatedGroup", "Ledger", "init_emulated_world", "emulated_topology", "ledger"]

BACKEND = "emulated"


@dataclass
class Ledger:
    """Collectives seen, per kind: ``calls[kind]`` launches and ``bytes[kind]`` bytes of full buffers."""

    calls: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)

    def add(self, kind: str, full_bytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += full_bytes

    def clear(self) -> None:
        self.calls.clear()
        self.bytes.clear()


@dataclass
class _State:
    topology: EmulatedTopology
    ledger: Ledger = field(default_factory=Ledger)
    active: dict[int, torch.Tensor] = field(default_factory=dict)  # device index -> running collectives


_state: _State | None = None


def emulated_topology() -> EmulatedTopology | None:
    """The topology of the emulated world this process plays in, or ``None``."""
    return _state.topology if _state is not None else None


def ledger() -> Ledger:
    """The collectives counted since the emulated world started (or since ``ledger().clear()``)."""
    if _state is None:
        raise RuntimeError("ledger(): no emulated world; call fsdp_compile.emulate.init_emulated_world(world) first")
    return _state.ledger


class _Work(dist._Work):
    """A launched emulated collective: ``wait()`` orders the caller's current stream after it."""

    def __init__(self, event: torch.cuda.Event | None, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._event, self._result = event, result

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._event is not None:
            torch.cuda.current_stream(self._event.device).wait_event(self._event)  # type: ignore[arg-type]
        return True

    def is_completed(self) -> bool:
        return self._event is None or self._event.query()

    def is_success(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut


def _scale(opts: Any, n: int, kind: str) -> float:
    """The factor that ``opts.reduceOp`` (default SUM) makes of n equal parts: a reduce-scatter already sums
    its n chunks (a mean for anything but SUM); an all-reduce is n buffers for SUM, one for the rest."""
    is_sum = (opts.reduceOp if opts is not None else dist.ReduceOp.SUM) == dist.ReduceOp.SUM
    if kind == "reduce_scatter":
        return 1.0 if is_sum else 1.0 / n
    return float(n) if is_sum else 1.0


# What the kernel moves itself (``kernels.hold``'s ``move``): (mode, src, dst, elements per chunk, chunks, scale).
_Data = tuple[str, torch.Tensor, torch.Tensor, int, int, float] | None


def _in_kernel(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda and t.is_contiguous() and t.dtype.is_floating_point for t in tensors)


def _single(mode: str, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], n: int,
            scale: float) -> _Data:
    """The kernel's data movement for a one-tensor all-gather or reduce-scatter, else ``None`` (torch ops)."""
    if len(outputs) != 1 or len(inputs) != 1:
        return None
    o, i = outputs[0], inputs[0]
    if (mode == "gather" and o.dtype != i.dtype) or not _in_kernel(o, i):
        return None
    return (mode, i, o, i.numel() if mode == "gather" else o.numel(), n, scale)


def _scaled(t: torch.Tensor, scale: float) -> torch.Tensor:
    return t if scale == 1.0 else t.mul_(scale)


class EmulatedGroup(PythonGroupDevices, dist.ProcessGroup):
    """One communicator of the emulated world (NOTE [emulated backend])."""

    def __init__(self, rank: int, size: int, ranks: Sequence[int]) -> None:
        super().__init__(rank, size)
        self._ranks = list(ranks)
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._flags: dict[int, torch.Tensor] = {}  # device index -> the communicator's flag
        self._token = 0
        self._name = self._desc = ""

    def getBackendName(self) -> str:  # noqa: N802 (torch's names, called from C++)
        return BACKEND

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def __repr__(self) -> str:
        return f"EmulatedGroup(ranks {self._ranks[0]}..{self._ranks[-1]} of {len(self._ranks)})"

    def _launch(self, kind: str, full: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor],
                move: Callable[[], None], result: list[torch.Tensor], data: _Data = None) -> _Work:
        """Count the collective (``full``: its full buffers), then run NOTE [emulated kernel] on the group's
        stream, moving ``data`` (``None``: after ``move``'s torch ops); on CPU, just ``move``."""
        assert _state is not None, "an emulated group outlived its world"
        full_bytes = sum(t.numel() * t.element_size() for t in full)
        _state.ledger.add(kind, full_bytes)
        cuda = [t for t in tensors if t.is_cuda]
        if not cuda:
            move()
            return _Work(None, result)
        from fsdp_compile.emulate import kernels  # needs triton: imported where a GPU is in use
        device = cuda[0].device
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
            self._flags[index] = torch.zeros(1, dtype=torch.int64, device=device)  # last finished token
        if index not in _state.active:
            _state.active[index] = torch.zeros(1, dtype=torch.int64, device=device)
        stream, caller = self._streams[index], torch.cuda.current_stream(index)
        stream.wait_stream(caller)
        self._token += 1
        solo_ns = int(_state.topology.solo_seconds(kind, full_bytes, self._ranks) * 1e9)
        with torch.cuda.stream(stream):
            if data is None:
                move()
            kernels.hold(kind, active=_state.active[index], flag=self._flags[index], token=self._token,
                         solo_ns=solo_ns, shared=_state.topology.shared, blocks=_state.topology.blocks, move=data)
            done = torch.cuda.Event()
            done.record(stream)
        for t in cuda:
            t.record_stream(stream)
        return _Work(done, result)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> _Work:
        def move() -> None:
            for outs, inp in zip(output_tensors, input_tensors):
                for o in outs:
                    o.copy_(inp)

        outs = [o for os in output_tensors for o in os]
        return self._launch("all_gather", outs, outs + list(input_tensors), move, outs)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> _Work:
        n = self.size()

        def move() -> None:
            for o, i in zip(outputs, inputs):
                o.view(n, -1).copy_(i.reshape(1, -1).expand(n, -1))

        data = _single("gather", outputs, inputs, n, 1.0)
        return self._launch("all_gather", outputs, list(outputs) + list(inputs), move, list(outputs), data)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                       opts: Any = None) -> _Work:
        scale = _scale(opts, self.size(), "reduce_scatter")

        def move() -> None:
            for o, ins in zip(outputs, input_lists):
                if o.dtype.is_floating_point:
                    _scaled(torch.stack(list(ins)).sum(0, out=o), scale)
                else:
                    o.copy_(ins[0])

        ins = [i for il in input_lists for i in il]
        return self._launch("reduce_scatter", ins, list(outputs) + ins, move, list(outputs))

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> _Work:
        n = self.size()
        scale = _scale(opts, n, "reduce_scatter")

        def move() -> None:
            for o, i in zip(outputs, inputs):
                if o.dtype.is_floating_point:
                    _scaled(torch.sum(i.reshape(n, -1), dim=0, out=o.view(-1)), scale)
                else:
                    o.view(-1).copy_(i.reshape(n, -1)[0])

        data = _single("reduce", outputs, inputs, n, scale)
        return self._launch("reduce_scatter", inputs, list(outputs) + list(inputs), move, list(outputs), data)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        scale = _scale(opts, self.size(), "all_reduce")

        def move() -> None:
            if scale != 1.0:
                for t in tensors:
                    t.mul_(int(scale) if not t.dtype.is_floating_point else scale)

        data = ("scale", tensors[0], tensors[0], tensors[0].numel(), 1, scale) \
            if len(tensors) == 1 and _in_kernel(tensors[0]) else None
        return self._launch("all_reduce", tensors, list(tensors), move, list(tensors), data)

    allreduce_coalesced = allreduce

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        return self._launch("broadcast", tensors, list(tensors), lambda: None, list(tensors))

    def barrier(self, opts: Any = None) -> _Work:
        assert _state is not None
        _state.ledger.add("barrier", 0)
        return _Work(None, [])

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                          input_split_sizes: Any = None, opts: Any = None) -> _Work:
        def move() -> None:
            output.view(-1)[: min(output.numel(), input.numel())].copy_(input.view(-1)[: output.numel()])

        return self._launch("all_to_all", [input], [output, input], move, [output])

    alltoall_base = all_to_all_single

    def send(self, *args: Any) -> _Work:
        raise NotImplementedError("the emulated world has no other process: send/recv (pipeline parallelism) "
                                  "cannot be emulated; run data-parallel collectives only")

    recv = send


def _create(opts: Any, backend_options: Any) -> EmulatedGroup:
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    return EmulatedGroup(opts.group_rank, opts.group_size, ranks)


_out_forms: torch.library.Library | None = None


def _all_gather_out(input: torch.Tensor, group_size: int, group: Any, *, out: torch.Tensor) -> torch.Tensor:
    pg = resolve_group(group) if isinstance(group, str) else group
    work = dist.all_gather_into_tensor(out, input, group=pg, async_op=True)
    register_collective_work(out, work)
    return out


def _install_out_forms() -> None:
    """Route ``_c10d_functional.all_gather_into_tensor_out`` through the group's Python method: torch's kernel
    asks for a C++ backend, which a Python process group has not (the other ops reach the group already)."""
    global _out_forms
    if _out_forms is None:
        _out_forms = torch.library.Library("_c10d_functional", "IMPL")
        with warnings.catch_warnings():  # "Overriding a previously registered kernel": intended
            warnings.simplefilter("ignore")
            _out_forms.impl("all_gather_into_tensor_out", _all_gather_out, "CompositeExplicitAutograd")


def init_emulated_world(world: int | EmulatedTopology, *, hosts: int = 1, hardware: str | Hardware = "h200",
                        calibration: str | None = None, blocks: int = 32,
                        shared: float = SHARED_LINKS) -> EmulatedTopology:
    """Make this process rank 0 of ``world`` ranks on ``hosts`` hosts, on the emulated backend.

    Call it instead of ``init_process_group`` (NOTE [emulated backend]); ``dist.destroy_process_group()`` ends
    the world. ``hardware``: a preset name or a ``Hardware``; ``calibration``: a JSON of measured numbers over
    it; ``blocks``, ``shared``: see ``EmulatedTopology``. Returns the topology.
    """
    global _state
    if dist.is_initialized():
        raise RuntimeError("init_emulated_world: a default process group exists already; call it instead of "
                           "init_process_group, or dist.destroy_process_group() first.")
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    topology = world if isinstance(world, EmulatedTopology) else EmulatedTopology(
        world, load_hardware(hardware, calibration), hosts=hosts, blocks=blocks, shared=shared)
    _state = _State(topology)
    _install_out_forms()
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=topology.world)
    return topology
