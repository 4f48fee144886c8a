"""``passes/body_views.py`` (NOTE [views in loop bodies]): on a functional loop body, traced without
any process group, view copies become views, clones of views that only matmuls read go, and what
the body returns stays a copy."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from passes.body_views import body_views_pass

aten = torch.ops.aten


def _body(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weight = aten.view_copy(w, [4, 3])  # a gathered weight, flat, viewed as its shape
    h = aten.mm(x, aten.clone(aten.permute(weight, [1, 0]), memory_format=torch.contiguous_format))
    halves = aten.select_copy(aten.view_copy(h, [2, 2, 2]), -1, 0)  # read, not returned
    kept = aten.t_copy(h)  # returned: stays a copy
    both = aten.clone(aten.permute(h, [1, 0]))  # a clone that an add reads: stays
    return halves + 1, kept, both + 1


def _backward_body(w: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As a loop's backward body holds them: a weight transposed, copied and transposed back for its
    matmul, and a weight gradient transposed and copied twice on its way to the reduce-scatter's pack."""
    from passes.copies import pack_rows

    dx = aten.mm(dy, aten.permute(aten.clone(aten.permute(w, [1, 0])), [1, 0]))
    grad = aten.mm(aten.permute(dy, [1, 0]), x)
    twice = aten.clone(aten.permute(aten.clone(aten.permute(grad, [1, 0])), [1, 0]))
    return dx, pack_rows([twice], 2, torch.float32)


def _targets(gm: torch.fx.GraphModule) -> list[object]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_a_loop_bodys_view_copies_become_views_and_its_returned_copies_stay() -> None:
    x, w = torch.randn(2, 3), torch.randn(12)
    gm = make_fx(_body, tracing_mode="fake")(x, w)
    assert _targets(gm).count(aten.clone.default) == 2
    body_views_pass(gm)
    targets = _targets(gm)
    assert aten.view_copy.default not in targets and aten.select_copy.int not in targets
    assert targets.count(aten.view.default) == 2 and aten.select.int in targets
    assert targets.count(aten.t_copy.default) == 1  # the returned one
    assert targets.count(aten.clone.default) == 1  # the add's; the matmul's went
    (mm,) = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    assert mm.args[1].target is aten.permute.default
    (select,) = [n for n in gm.graph.nodes if n.target is aten.select.int]
    assert select.meta["val"].stride() == (4, 2)  # a view's strides, not a copy's
    for got, want in zip(gm(x, w), _body(x, w)):
        torch.testing.assert_close(got, want)


def test_transposes_that_undo_each_other_and_copies_before_the_pack_go() -> None:
    w, x, dy = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5, 3)
    gm = make_fx(_backward_body, tracing_mode="fake")(w, x, dy)
    assert _targets(gm).count(aten.clone.default) == 3
    body_views_pass(gm)
    assert aten.clone.default not in _targets(gm)
    first, second = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    assert first.args[1].op == "placeholder"  # the weight itself
    (pack,) = [n for n in gm.graph.nodes if n.target is torch.ops.fsdp.pack_rows.default]
    assert pack.args[0] == [second]  # the gradient as the matmul made it
    for got, want in zip(gm(w, x, dy), _backward_body(w, x, dy)):
        torch.testing.assert_close(got, want)
