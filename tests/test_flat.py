"""A flat shard per unit and dtype (NOTE [flat shards] in fsdp_compile/api/flat_shard.py): layout, reads,
gradients handed out, and what keeps parameters and flat in step.

The numerics here run in this process on a gloo group of one rank with the collectives kept
(``elide_single_rank=False``), against the same model unsharded; several ranks: tests/test_numerics.py.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import tempfile
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import fx

from fsdp_compile import FsdpGroups, fully_shard, make_backend
from fsdp_compile.compiler.backend import observe_graphs
from fsdp_compile.examples.models import ModelConfig, Transformer
from fsdp_compile.api.units import FLATS, unit_of
from fsdp_compile.passes.capture.flat_inputs import split_flat_inputs_pass
from fsdp_compile.passes.predicates import is_reduce_grad, is_unshard

from .graph_utils import fake_process_group, shard_blocks_then_root

CFG = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, hidden_dim=16, max_seq_len=8)


_GROUPS: list[FsdpGroups] = []  # made inside gloo_world_of_one, destroyed with it (their heartbeat too)


@contextlib.contextmanager
def gloo_world_of_one() -> Iterator[None]:
    """A real gloo default group of one rank in this process."""
    assert not dist.is_initialized()
    torch._dynamo.reset()
    _GROUPS.clear()  # (groups of a fake world, gone with it)
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            yield
        finally:
            while _GROUPS:
                _GROUPS.pop().destroy()
            dist.destroy_process_group()


def _pairs(model: torch.nn.Module, ref: torch.nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, sharded param, reference param) for every parameter (world 1: the shard is the whole)."""
    ref_params = dict(ref.named_parameters())
    out = []
    for name, p in model.named_parameters():
        ref_name = name.replace("parametrizations.", "").replace(".original", "")
        out.append((ref_name, p, ref_params[ref_name]))
    return out


def _assert_grads_as_eager(model: torch.nn.Module, ref: torch.nn.Module) -> None:
    """Each parameter's ``.grad`` is its reference's: ``None`` where eager has none, else close."""
    for name, p, r in _pairs(model, ref):
        if r.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, r.grad, msg=lambda m, name=name: f"{name}: {m}")


def _sharded(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    ref = Transformer(CFG)
    groups = FsdpGroups.create()
    _GROUPS.append(groups)
    model = shard_blocks_then_root(copy.deepcopy(ref), groups)
    return model, ref


def test_a_unit_s_parameters_are_views_of_its_flat_shard() -> None:
    with fake_process_group(2):
        model, _ = _sharded()
        # the root holds others: a flat per parameter (NOTE [gradients in stretches] in passes/lower/markers.py)
        root = unit_of(model)
        assert root is not None and len(root.flats) == 3 and all(
            sp.flat is f and sp.offset == 0 and f.numel() == sp.shard.numel() for sp, f in zip(root.params, root.flats))
        for module in model.layers:
            unit = unit_of(module)
            assert unit is not None and len(unit.flats) == 1
            flat = unit.flats[0]
            assert flat.requires_grad and flat.dim() == 1
            assert sum(sp.shard.numel() for sp in unit.params) == flat.numel()
            for sp in unit.params:
                assert sp.shard.data_ptr() == flat.data_ptr() + sp.offset * flat.element_size()
                assert sp.shard.is_leaf and isinstance(sp.shard, torch.nn.Parameter)


def test_compiled_reads_find_each_flat_under_a_key_naming_its_unit_and_a_dropped_model_leaves() -> None:
    # (NOTE [one guard per read] in fsdp_compile/api/reads.py) keys name the unit in its model, so the same
    # model built again reads its flats under the same keys; a second live model's get a suffix
    with fake_process_group(2):
        model, _ = _sharded()
        other, _ = _sharded()
        mine, theirs = ({sp.read_plan[0]: unit_of(b).flats[0] for b in m.layers for sp in unit_of(b).params}
                        for m in (model, other))
        assert all(FLATS[k] is flat and k.startswith(f"layers.{i}#0") for i, (k, flat) in enumerate(mine.items()))
        assert len(theirs) == CFG.n_layers and not set(mine) & set(theirs)
        assert all(k.split("~")[0] == m.split("~")[0] for k, m in zip(theirs, mine))
        del model
        gc.collect()
        assert not set(mine) & set(FLATS) and set(theirs) <= set(FLATS)


def test_dynamo_takes_one_input_per_unit_and_backward_returns_each_flat_gradient_whole() -> None:
    with fake_process_group(2):
        model, _ = _sharded()
        inputs: list[int] = []
        ours = make_backend(inductor=False)

        def backend(gm: fx.GraphModule, example_inputs: list) -> object:
            inputs.append(sum(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs))
            return ours(gm, example_inputs)

        backend.__dict__.update(ours.__dict__)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        with observe_graphs() as seen:
            compiled(torch.randint(0, 32, (1, 8))).sum().backward()
    assert inputs == [5]  # two blocks, one flat each, and the root's embedding, final norm and head
    graphs = dict(seen)
    for gm in graphs.values():
        assert not any(is_unshard(n) or is_reduce_grad(n) for n in gm.graph.nodes)  # all lowered
    bw = graphs["backward"]
    # a block flat's gradient is its bucket's output, averaged (nothing scattered into zeros); a root flat's, a view
    assert not bw.graph.find_nodes(op="call_function", target=torch.ops.aten.slice_scatter.default)
    outputs = bw.graph.find_nodes(op="output")[0].args[0]
    grads = [o for o in outputs if isinstance(o, fx.Node)]
    flats = [g for g in grads if g.meta["val"].dim() == 1 and g.meta["val"].numel() > CFG.dim]
    assert sorted(str(g.target) for g in flats) == ["aten.div.Tensor"] * 2 + ["aten.view.default"] * 2


def _step(compiled: torch.nn.Module, tokens: torch.Tensor) -> None:
    compiled(tokens).square().mean().backward()


def test_gradients_are_handed_out_accumulated_and_cleared_like_autograd_s() -> None:
    tokens = torch.randint(0, 32, (2, 8))
    with gloo_world_of_one():
        model, ref = _sharded()
        compiled = torch.compile(model, backend=make_backend(elide_single_rank=False, inductor=False))
        for _ in range(2):  # two microbatches: the second adds to the first
            _step(compiled, tokens)
            _step(ref, tokens)
        for name, p, r in _pairs(model, ref):
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, r.grad, msg=lambda m, name=name: f"{name}: {m}")
        assert all(unit_of(m).flats[0].grad is None for m in model.layers)  # type: ignore[union-attr]
        model.zero_grad()
        ref.zero_grad()
        _step(compiled, tokens)
        _step(ref, tokens)
        for name, p, r in _pairs(model, ref):
            torch.testing.assert_close(p.grad, r.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_a_parameter_frozen_after_sharding_gets_no_gradient() -> None:
    tokens = torch.randint(0, 32, (2, 8))
    with gloo_world_of_one():
        model, ref = _sharded()
        for m in (model, ref):
            m.layers[0].attn.wq.parametrizations.weight.original.requires_grad_(False) if m is model else \
                m.layers[0].attn.wq.weight.requires_grad_(False)
        compiled = torch.compile(model, backend=make_backend(elide_single_rank=False, inductor=False))
        _step(compiled, tokens)
        _step(ref, tokens)
        for name, p, r in _pairs(model, ref):
            if name == "layers.0.attn.wq.weight":
                assert p.grad is None and r.grad is None
            else:
                torch.testing.assert_close(p.grad, r.grad, msg=lambda m, name=name: f"{name}: {m}")


def _frozen_before_sharding(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A Llama whose second block's attention projections are frozen before ``fully_shard`` (as an adapter
    fine-tune freezes base weights), and its unsharded reference."""
    torch.manual_seed(seed)
    ref = Transformer(CFG)
    for m in ref.layers[1].attn.children():
        m.requires_grad_(False)
    groups = FsdpGroups.create()
    _GROUPS.append(groups)
    return shard_blocks_then_root(copy.deepcopy(ref), groups), ref


def test_parameters_frozen_before_sharding_get_a_flat_that_requires_no_gradient() -> None:
    with fake_process_group(2):
        model, _ = _frozen_before_sharding()
        unit = unit_of(model.layers[1])
        assert unit is not None and sorted(f.requires_grad for f in unit.flats) == [False, True]
        for sp in unit.params:
            assert sp.flat is not None and sp.flat.requires_grad == sp.shard.requires_grad, sp.fqn


@pytest.mark.parametrize("elide", [False, True])
def test_parameters_frozen_before_sharding_train_as_eager_and_get_gradients_once_unfrozen(elide: bool) -> None:
    """The frozen flat is gathered and never reduced; a member unfrozen later is read from its own shard
    (the trace guards its ``requires_grad``: NOTE [flat shards]) and gets eager's gradient."""
    tokens = torch.randint(0, 32, (2, 8))
    with gloo_world_of_one():
        model, ref = _frozen_before_sharding()
        compiled = torch.compile(model, backend=make_backend(elide_single_rank=elide, inductor=False))
        ours, theirs = model.layers[1].attn.wq.parametrizations.weight.original, ref.layers[1].attn.wq.weight
        for unfrozen in (False, True, True):
            ours.requires_grad_(unfrozen)
            theirs.requires_grad_(unfrozen)
            _step(compiled, tokens)
            _step(ref, tokens)
            _assert_grads_as_eager(model, ref)
            model.zero_grad()
            ref.zero_grad()
        assert all(f.grad is None for f in unit_of(model.layers[1]).flats)  # type: ignore[union-attr]


class _TwoDtypes(torch.nn.Module):
    """fp32 matrices beside an fp64 scale and shift: a unit of two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 8)
        self.down = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.rand(8, dtype=torch.float64) + 0.5)
        self.shift = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)) * self.scale.float() + self.shift.float())


def test_a_unit_of_two_dtypes_has_a_flat_of_each_and_trains_as_eager() -> None:
    x = torch.randn(4, 8)
    with gloo_world_of_one():
        torch.manual_seed(0)
        ref = torch.nn.Sequential(_TwoDtypes(), _TwoDtypes(), torch.nn.Linear(8, 2))
        model = copy.deepcopy(ref)
        groups = FsdpGroups.create()
        _GROUPS.append(groups)
        for block in model[:2]:
            fully_shard(block, groups=groups)
        fully_shard(model, groups=groups)
        for block in model[:2]:
            unit = unit_of(block)
            assert unit is not None and sorted(str(f.dtype) for f in unit.flats) == ["torch.float32", "torch.float64"]
            assert all(sp.flat is not None and sp.flat.dtype == sp.shard.dtype for sp in unit.params)
        inputs: list[int] = []
        ours = make_backend(elide_single_rank=False, inductor=False)

        def backend(gm: fx.GraphModule, example_inputs: list) -> object:
            inputs.append(sum(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs))
            return ours(gm, example_inputs)

        backend.__dict__.update(ours.__dict__)
        compiled = torch.compile(model, backend=backend)
        for _ in range(2):  # the second step adds to the first's gradients
            compiled(x).square().mean().backward()
            ref(x).square().mean().backward()
        assert inputs == [2 + 2 + 2]  # two flats per block; the root's weight and bias
        for name, p, r in _pairs(model, ref):
            assert p.grad is not None and p.grad.dtype == r.dtype, name
            torch.testing.assert_close(p.grad, r.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_a_parameter_alone_in_its_unit_gets_a_flat_of_its_own_and_trains_as_eager() -> None:
    """Blocks of one bias-free Linear each: every block's one parameter is a flat of its own, gathered
    and reduced as it is, its gradient reaching the parameter through autograd."""
    x = torch.randn(4, 8)
    with gloo_world_of_one():
        torch.manual_seed(0)
        ref = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 8, bias=False),
                                  torch.nn.Linear(8, 2))
        model = copy.deepcopy(ref)
        groups = FsdpGroups.create()
        _GROUPS.append(groups)
        for block in (model[0], model[2]):
            fully_shard(block, groups=groups)
        fully_shard(model, groups=groups)
        for block in (model[0], model[2]):
            unit = unit_of(block)
            assert unit is not None and len(unit.flats) == 1 and unit.flats[0].shape == (64,)
        compiled = torch.compile(model, backend=make_backend(elide_single_rank=False, inductor=False))
        for _ in range(2):
            compiled(x).square().mean().backward()
            ref(x).square().mean().backward()
        for name, p, r in _pairs(model, ref):
            torch.testing.assert_close(p.grad, r.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_replaced_parameter_data_is_read_by_the_next_compiled_step() -> None:
    tokens = torch.randint(0, 32, (2, 8))
    with gloo_world_of_one():
        model, ref = _sharded()
        compiled = torch.compile(model, backend=make_backend(elide_single_rank=False, inductor=False))
        _step(compiled, tokens)
        wq = model.layers[0].attn.wq.parametrizations.weight.original
        new = torch.randn_like(wq)
        wq.data = new.clone()  # not in place: the flat no longer holds what the parameter holds
        ref.layers[0].attn.wq.weight.data = new.clone()
        out, expected = compiled(tokens), ref(tokens)
        torch.testing.assert_close(out, expected)
        flat = unit_of(model.layers[0]).flats[0]  # type: ignore[union-attr]
        sp = next(sp for sp in unit_of(model.layers[0]).params if sp.shard is wq)  # type: ignore[union-attr]
        assert wq.data_ptr() == flat.data_ptr() + sp.offset * flat.element_size()  # a view of the flat again


def test_replaced_parameter_data_of_another_dtype_raises_naming_the_fix() -> None:
    tokens = torch.randint(0, 32, (2, 8))
    with gloo_world_of_one():
        model, _ = _sharded()
        compiled = torch.compile(model, backend=make_backend(elide_single_rank=False, inductor=False))
        _step(compiled, tokens)
        wq = model.layers[0].attn.wq.parametrizations.weight.original
        wq.data = wq.data.double()
        with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq\.weight.*model\.to\("):
            compiled(tokens)


def test_module_to_lays_the_flat_shards_out_again() -> None:
    tokens = torch.randint(0, 32, (2, 8))
    with gloo_world_of_one():
        model, ref = _sharded()
        old = [weakref.ref(f) for b in model.layers for f in unit_of(b).flats]  # type: ignore[union-attr]
        model.to(torch.float64)
        ref.to(torch.float64)
        gc.collect()
        assert all(f() is None for f in old)  # the fp32 flats laid out before are freed
        for module in model.layers:
            unit = unit_of(module)
            assert [f.dtype for f in unit.flats] == [torch.float64]  # type: ignore[union-attr]
            for sp in unit.params:  # type: ignore[union-attr]
                assert sp.shard.data_ptr() == unit.flats[0].data_ptr() + sp.offset * 8  # type: ignore[union-attr]
        compiled = torch.compile(model, backend=make_backend(elide_single_rank=False, inductor=False))
        _step(compiled, tokens)
        _step(ref, tokens)
        for name, p, r in _pairs(model, ref):
            torch.testing.assert_close(p.grad, r.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_hooks_registered_on_a_parameter_of_a_flat_run_as_autograd_runs_them() -> None:
    tokens = torch.randint(0, 32, (2, 8))
    with gloo_world_of_one():
        model, ref = _sharded()
        seen: list[str] = []
        wq = model.layers[0].attn.wq.parametrizations.weight.original
        wq.register_hook(lambda g: g * 2)  # changes the gradient, as autograd lets it
        wq.register_post_accumulate_grad_hook(lambda p: seen.append("after"))
        ref.layers[0].attn.wq.weight.register_hook(lambda g: g * 2)
        compiled = torch.compile(model, backend=make_backend(elide_single_rank=False, inductor=False))
        _step(compiled, tokens)
        _step(ref, tokens)
        assert seen == ["after"]
        torch.testing.assert_close(wq.grad, ref.layers[0].attn.wq.weight.grad)


def test_autograd_grad_and_backward_inputs_see_the_parameters_of_a_flat() -> None:
    """(NOTE [gradients through the parameters]) The compiled graph reads the flat, and the parameters are
    still in the autograd graph: ``torch.autograd.grad`` returns eager's gradients without touching any
    ``.grad``, and ``backward(inputs=...)`` fills only the ``.grad`` of those asked for."""
    tokens = torch.randint(0, 32, (2, 8))
    with gloo_world_of_one():
        model, ref = _sharded()
        compiled = torch.compile(model, backend=make_backend(elide_single_rank=False, inductor=False))
        pairs = _pairs(model, ref)
        ours = torch.autograd.grad(compiled(tokens).square().mean(), [p for _, p, _ in pairs])
        theirs = torch.autograd.grad(ref(tokens).square().mean(), [r for _, _, r in pairs])
        for (name, p, _), g, r in zip(pairs, ours, theirs):
            assert p.grad is None, name
            torch.testing.assert_close(g, r, msg=lambda m, name=name: f"{name}: {m}")
        asked = [(name, p, r) for name, p, r in pairs if name.startswith("layers.1.")]
        compiled(tokens).square().mean().backward(inputs=[p for _, p, _ in asked])
        ref(tokens).square().mean().backward(inputs=[r for _, _, r in asked])
        _assert_grads_as_eager(model, ref)
        assert len(asked) == 9 and all(f.grad is None for m in model.layers for f in unit_of(m).flats)  # type: ignore[union-attr]


def test_where_collectives_are_elided_a_flat_is_read_as_its_parameters() -> None:
    """(NOTE [elided flats]) at one rank with the collectives elided (the default) the graph takes each
    parameter, not the flat: no flat gradient is built (no cat), and autograd gives each parameter its
    gradient itself, accumulated, its hooks run, as on the unsharded model."""
    tokens = torch.randint(0, 32, (2, 8))
    with gloo_world_of_one():
        model, ref = _sharded()
        seen_by_hook: list[torch.Size] = []
        model.layers[0].attn.wq.parametrizations.weight.original.register_hook(lambda g: seen_by_hook.append(g.shape))
        compiled = torch.compile(model, backend=make_backend(inductor=False))
        with observe_graphs() as seen:
            for _ in range(2):
                _step(compiled, tokens)
                _step(ref, tokens)
        bw = dict(seen)["backward"]
        for target in (torch.ops.aten.cat.default, torch.ops.aten.slice_scatter.default):
            assert not bw.graph.find_nodes(op="call_function", target=target)
        assert seen_by_hook == [torch.Size([16, 16])] * 2
        # switched off by name, the flats stay whole: their gradients are built from the pieces'
        model_whole, _ = _sharded()
        whole = torch.compile(model_whole, backend=make_backend(inductor=False, disabled_passes=["split_flat_inputs"]))
        with observe_graphs() as seen_whole:
            _step(whole, tokens)
        assert dict(seen_whole)["backward"].graph.find_nodes(op="call_function", target=torch.ops.aten.cat.default)
        assert all(unit_of(m).flats[0].grad is None for m in model.layers)  # type: ignore[union-attr]
        for name, p, r in _pairs(model, ref):
            torch.testing.assert_close(p.grad, r.grad, msg=lambda m, name=name: f"{name}: {m}")


def test_splitting_a_flat_input_reads_each_piece_from_an_input_of_its_own() -> None:
    def reads(flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return flat.narrow(0, 0, 4).view(2, 2) @ x + flat.narrow(0, 4, 2).view(2)

    gm = fx.symbolic_trace(reads)
    layout = {"flat": [(0, 4, (2, 2)), (4, 2, (2,))]}
    split = split_flat_inputs_pass(gm, pieces=layout)
    assert [n.name for n in split.graph.find_nodes(op="placeholder")] == ["flat_piece0", "flat_piece1", "x"]
    assert not split.graph.find_nodes(op="call_method", target="narrow")
    flat, x = torch.randn(6), torch.randn(2, 2)
    torch.testing.assert_close(split(flat[:4].view(2, 2), flat[4:], x), reads(flat, x))
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == ["flat", "x"]  # the given graph kept

    def reads_whole(flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # a read that is no piece
        return flat.narrow(0, 0, 4).view(2, 2) @ x + flat.sum()

    whole = fx.symbolic_trace(reads_whole)
    assert split_flat_inputs_pass(whole, pieces=layout) is whole


@pytest.mark.parametrize("frozen_at_compile", [False, True])
def test_where_collectives_are_elided_freezing_and_unfreezing_after_compiling_train_as_eager(
        frozen_at_compile: bool) -> None:
    """(NOTE [elided flats]) A parameter frozen after the first compiled step gets no gradient; one frozen
    when the graph was compiled (its flat then stays whole) gets its gradient once unfrozen."""
    tokens = torch.randint(0, 32, (2, 8))
    with gloo_world_of_one():
        model, ref = _sharded()
        compiled = torch.compile(model, backend=make_backend(inductor=False))
        ours, theirs = model.layers[0].attn.wq.parametrizations.weight.original, ref.layers[0].attn.wq.weight
        for frozen in ([True, False] if frozen_at_compile else [False, True, False]):
            ours.requires_grad_(not frozen)
            theirs.requires_grad_(not frozen)
            _step(compiled, tokens)
            _step(ref, tokens)
            _assert_grads_as_eager(model, ref)
            model.zero_grad()
            ref.zero_grad()
