"""The order of collective launches and waits survives Inductor: read its generated code.

Inductor's own memory-driven reordering would move waits back next to their launches; the backend
pins the schedule (NOTE [pinning the schedule] in fsdp_compile/compiler/backend.py). These tests compile the
3-unit model of tests/test_schedules.py with Inductor under a fake process group and compare the
launches and waits in the generated code with the scheduled FX graph's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any
from unittest import mock

import torch
from torch._inductor.utils import fresh_cache, run_and_get_code

from fsdp_compile import FsdpGroups, make_backend

from fsdp_compile.safety import agreement

from fsdp_compile.safety import lockstep
from fsdp_compile.compiler import backend
from fsdp_compile.compiler.backend import observe_graphs
from fsdp_compile.inspection.schedule import rows
from fsdp_compile.passes.predicates import is_all_gather, waited_collective

from .graph_utils import FakeWorldTestCase, ThreeUnits, shard_blocks_then_root
from .test_outline import Mlp
from .test_schedules_root import EmbeddingAndHead, EmbeddingNormAndHead

_LAUNCH = re.compile(r"(\w+) = torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor)\.default\(")
# a bucket's in-place all-gather (NOTE [in-place all-gather]) returns nothing: its buffer is ``out=``
_LAUNCH_OUT = re.compile(r"torch\.ops\._c10d_functional\.(all_gather_into_tensor)_out\.default\(.*out=(\w+)\)")
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)")
_CHECK_IN = re.compile(r"torch\.ops\.fsdp\.check_in\.default\(")
_CALL = re.compile(r"^\s+\w+ = (partitioned_\w+)\(\w+_args\)")  # an outlined body's call
_KIND = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


def emitted_order(code: str) -> list[str]:
    """Collective launches and waits in the order Inductor's generated code runs them."""
    kind_of: dict[str, str] = {}
    out = []
    for line in code.splitlines():
        if m := _LAUNCH.search(line) or _LAUNCH_OUT.search(line):
            name, kind = (m.group(1), m.group(2)) if m.re is _LAUNCH else (m.group(2), m.group(1))
            kind_of[name] = _KIND[kind]
            out.append(_KIND[kind])
        elif m := _WAIT.search(line):
            out.append(f"wait {kind_of.get(m.group(1), '?')}")
        elif m := _CALL.search(line):
            out.append("call")
        elif _CHECK_IN.search(line):
            out.append("check_in")
    return out


def fx_order(gm: torch.fx.GraphModule) -> list[str]:
    out = []
    for r in rows(gm):
        if r.op in ("all_gather", "reduce_scatter"):
            out.append(r.op)
        elif r.op == "wait":
            launch = waited_collective(r.nodes[0])
            out.append(f"wait {'all_gather' if is_all_gather(launch) else 'reduce_scatter'}")
        else:
            out += ["call" for n in r.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    return out


class InductorOrderTest(FakeWorldTestCase):
    """The order of launches and waits survives Inductor: read its generated code."""

    def compiled_orders(self, model: torch.nn.Module | None = None, grad_in: bool = False,
                        example: torch.Tensor | None = None,
                        **backend_kw: Any) -> tuple[list[list[str]], list[list[str]]]:
        groups = FsdpGroups.create()
        torch.manual_seed(0)
        model = torch.compile(shard_blocks_then_root(model or ThreeUnits(), groups), backend=make_backend(**backend_kw))
        with observe_graphs() as seen:
            x = torch.randn(4, 8, requires_grad=grad_in) if example is None else example
            _, codes = run_and_get_code(lambda: model(x).sum().backward())
        return [fx_order(gm) for _, gm in seen], [emitted_order(c) for c in codes]

    def test_emitted_order_matches_schedule(self) -> None:
        for kw in ({}, {"prefetch": 2}, {"schedule": "delayed"}, {"bucket_alone_bytes": 200},
                   {"inplace_gather": False}):
            fx, emitted = self.compiled_orders(**kw)
            self.assertEqual(len(emitted), 2)
            self.assertEqual(emitted, fx, f"Inductor reordered collectives with {kw}")

    def test_outlined_calls_keep_their_place(self) -> None:
        # (NOTE [outlined units]) Each block is a call of one compiled body; the calls, and the
        # collectives around them, run in the scheduled order.
        fx, emitted = self.compiled_orders(Mlp(), grad_in=True)  # (else block 0's body differs: its input)
        self.assertEqual([o.count("call") for o in fx], [3, 3])
        self.assertEqual(emitted, fx)

    def test_a_root_reduced_in_stretches_keeps_its_order(self) -> None:
        # (NOTE [gradients in stretches]) the root's head is reduce-scattered first, its embedding last;
        # with a final norm, the head's before the wait for the root's gather, the norm's after it.
        fx, emitted = self.compiled_orders(EmbeddingAndHead(), example=torch.randint(0, 16, (4,)))
        self.assertEqual(fx[1].count("reduce_scatter"), 4)  # two blocks, and the root twice
        self.assertEqual(emitted, fx)
        fx, emitted = self.compiled_orders(EmbeddingNormAndHead(), example=torch.randint(0, 16, (4,)))
        self.assertEqual(fx[1].count("reduce_scatter"), 5)  # two blocks, and the root three times
        self.assertLess(fx[1].index("reduce_scatter"), fx[1].index("wait all_gather"))
        self.assertEqual(emitted, fx)

    def test_without_pinning_inductor_undoes_the_schedule(self) -> None:
        # The control: without the backend's patch, Inductor's own reordering moves waits back next to
        # their launches.
        with mock.patch.object(backend, "inductor_config_patch", lambda changes: contextlib.nullcontext()):
            fx, emitted = self.compiled_orders()
        self.assertNotEqual(emitted, fx)

    def test_the_check_in_runs_before_every_collective(self) -> None:
        # (NOTE [lockstep]) A graph with peers checks in with them first, also when it was loaded from
        # the caches. A fake group has no peers, so the test gives each graph an identity, and
        # records the check-ins instead of making them.
        identity = agreement.GraphIdentity(kind="", collectives=(), groups=((0, 1),), timeout_s=1.0)
        checked: list[str] = []
        with (mock.patch.object(agreement, "identify", lambda gm, kind, *_: dataclasses.replace(identity, kind=kind)),
              mock.patch.object(agreement, "check_agreement", lambda graph: None),
              mock.patch.object(lockstep, "check_agreement", lambda graph: None),
              mock.patch.object(lockstep, "_before_call", lambda graph: checked.append(graph.kind))):
            fx, emitted = self.compiled_orders()
        self.assertEqual(emitted, [["check_in", *order] for order in fx])
        self.assertEqual(checked, ["forward", "backward"])


class OutputStridesTest(FakeWorldTestCase):
    """NOTE [output strides] in fsdp_compile/_compat.py: with Inductor's stride padding on (CUDA's
    default, switched on here for the CPU), the gradients a backward returns keep the strides they were
    traced with, so autograd does not copy each one into its parameter's layout. One rank: its
    gradients leave the backward as they were computed, with no collective in between."""

    world_size = 1

    def grad_strides(self, **backend_kw: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        torch.manual_seed(0)
        # width 1030: a weight row of 1030 floats is above Inductor's padding threshold (1024)
        model = shard_blocks_then_root(Mlp(n_layers=3, width=1030), FsdpGroups.create())
        compiled = torch.compile(model, backend=make_backend(**backend_kw))
        params = [p for p in model.parameters() if p.dim() == 2]
        padding = {"comprehensive_padding": True, "disable_padding_cpu": False}
        # a fresh cache: the FX graph cache's key does not hold the marks, so the control would hit
        with fresh_cache(), torch._inductor.config.patch(padding):  # the backward compiles at its first call
            loss = compiled(torch.randn(4, 1030, requires_grad=True)).sum()
            grads = torch.autograd.grad(loss, params)  # as the backward returned them: no AccumulateGrad
        return [(p.stride(), g.stride()) for p, g in zip(params, grads)]

    def test_gradients_leave_the_backward_in_their_parameters_layout(self) -> None:
        for kw in ({}, {"outline": False}):
            strides = self.grad_strides(**kw)
            self.assertEqual(len(strides), 6)
            self.assertEqual([p for p, _ in strides], [g for _, g in strides], f"padded gradients with {kw}")

    def test_unmarked_outputs_come_back_padded(self) -> None:
        # The control: without the marks, Inductor pads the weights' gradients (row stride 1056).
        with mock.patch("fsdp_compile.compiler.backend.keep_output_strides", lambda gm, outputs: None):
            strides = self.grad_strides(outline=False)
        self.assertIn((1056, 1), [g for _, g in strides])
