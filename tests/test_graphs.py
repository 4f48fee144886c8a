"""The graphs handed to Inductor: which group each collective runs on, and what forward saves."""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import fx
from torch.nn.utils import parametrize

from fsdp_compile import FsdpGroups, make_backend
from fsdp_compile.api.markers import ANONYMOUS_UNIT
from fsdp_compile.api.units import FLATS
from fsdp_compile.compiler.outlined_markers import name_markers
from fsdp_compile.compiler.pipeline import PASS_NAMES, STAGES, BackendOptions
from fsdp_compile.examples.models import Transformer
from fsdp_compile.passes.predicates import is_all_gather, is_reduce_scatter, is_unshard, marker_args

from .graph_utils import SMALL, capture, collectives, gathered_values, shard_blocks_then_root


def _tokens() -> torch.Tensor:
    return torch.zeros(2, 4, dtype=torch.long)


@pytest.mark.parametrize("dedicated", ["reduce_scatter", "all_gather", "none"])
def test_collectives_on_their_groups(fake_world: int, dedicated: str) -> None:
    groups = FsdpGroups.create(dedicated=dedicated)
    graphs = capture(shard_blocks_then_root(Transformer(SMALL), groups), _tokens())
    ag_name, rs_name = groups.all_gather.group_name, groups.reduce_scatter.group_name
    assert (ag_name != rs_name) == (dedicated != "none")
    fwd, bwd = graphs["forward"], graphs["backward"]
    for gm in (fwd, bwd):
        for node in collectives(gm):
            expected = ag_name if is_all_gather(node) else rs_name
            assert node.args[-1] == expected, (node.format_node(), expected)
    assert not any(is_reduce_scatter(n) for n in fwd.graph.nodes)
    n_params = sum(1 for _ in Transformer(SMALL).parameters())
    assert sum(map(is_all_gather, fwd.graph.nodes)) > 0
    assert sum(map(is_reduce_scatter, bwd.graph.nodes)) > 0
    # every sharded param is reduced exactly once (the per-param lowering; buckets come later)
    assert sum(map(is_reduce_scatter, bwd.graph.nodes)) <= n_params
    groups.destroy()


def test_forward_saves_shards_not_full_params(groups: FsdpGroups) -> None:
    model = shard_blocks_then_root(Transformer(SMALL), groups)
    graphs = capture(model, _tokens())
    fwd, bwd = graphs["forward"], graphs["backward"]
    (out,) = fwd.graph.find_nodes(op="output")
    saved = [a for a in out.args[0][1:] if isinstance(a, torch.fx.Node)]
    assert saved, "forward saves something for backward"
    gathered = gathered_values(fwd)
    assert not [n.name for n in saved if n in gathered], "a gathered param is saved for backward"
    shards = {n for n in fwd.graph.find_nodes(op="placeholder")}
    assert any(n in shards for n in saved), "the shards are what backward gathers again from"
    # ... and backward gathers again (reshard after forward)
    assert any(map(is_all_gather, bwd.graph.nodes))


def test_reshard_false_keeps_gathered_params(groups: FsdpGroups) -> None:
    model = shard_blocks_then_root(Transformer(SMALL), groups, reshard_after_forward=False)
    graphs = capture(model, _tokens())
    assert not any(map(is_all_gather, graphs["backward"].graph.nodes))


def test_model_without_sharded_params_is_plain_inductor(fake_world: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    expected = model(x)
    graphs = capture(model, x, inductor=True)
    assert not any(collectives(gm) for gm in graphs.values())
    out = torch.compile(model, backend=make_backend())(x)
    torch.testing.assert_close(out, expected)


def test_make_backend_names_an_unknown_option_and_the_known_ones() -> None:
    """The options are ``BackendOptions``' fields, written once; a misspelt one says which exist."""
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['prefech'\]; the options are \['schedule', 'prefetch'"):
        make_backend(prefech=2)


def test_disabled_passes_take_the_name_of_any_pass_the_backend_runs() -> None:
    """``PASS_NAMES`` is every name of the stages' lists, each once; any other name raises, listing them."""
    names = [name for stage in STAGES for name, _ in stage]
    assert list(PASS_NAMES) == names and len(set(names)) == len(names)
    assert {"split_flat_inputs", "outline", "group_markers", "lower", "prefetch", "absorb"} <= set(names)
    assert BackendOptions(disabled_passes=["name_markers", "absorb"]).disabled_passes == ("name_markers", "absorb")
    with pytest.raises(ValueError, match=r"disabled_passes \['nope'\] match no pass; known: \['split_flat_inputs', 'outline'"):
        make_backend(disabled_passes=["absorb", "nope"])


def _markers(gm: fx.GraphModule) -> list[SimpleNamespace]:
    return [marker_args(n) for m in gm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes
            if is_unshard(n)]


@pytest.mark.parametrize("outline", [None, False])
def test_a_traced_read_names_no_unit_and_the_backend_names_every_marker(groups: FsdpGroups, outline: bool | None) -> None:
    """(NOTE [anonymous reads]) Dynamo's graph holds no unit numbering, for blocks and root alike; before
    any pass looks at a marker, ``name_markers`` gives it the unit and name of the parameter it reads
    (a piece of its unit's flat shard, or a shard of its own)."""
    model = shard_blocks_then_root(Transformer(SMALL), groups, outline=outline)
    backend, seen = make_backend(inductor=False), {}

    @functools.wraps(backend)  # (our backend still: NOTE [regions for our backend only])
    def spy(gm: fx.GraphModule, example_inputs: Any) -> Any:
        seen["traced"] = _markers(gm)
        seen["named"] = _markers(name_markers(copy.deepcopy(gm), example_inputs=example_inputs))
        return backend(gm, example_inputs)

    torch.compile(model, backend=spy, fullgraph=True)(_tokens()).sum().backward()
    names = {name for name, _ in Transformer(SMALL).named_parameters()}
    assert len(seen["traced"]) == len(names)
    assert {(m.unit, m.names) for m in seen["traced"]} == {(ANONYMOUS_UNIT, "")}
    assert {m.names for m in seen["named"]} == names
    blocks = len(Transformer(SMALL).layers)
    assert {m.unit for m in seen["named"] if m.names.startswith("layers.")} == set(range(blocks))
    assert {m.unit for m in seen["named"] if not m.names.startswith("layers.")} == {blocks}  # the root, last


def test_the_guards_skip_a_module_reading_flats_whole_and_check_one_reading_shards(groups: FsdpGroups) -> None:
    """(NOTE [tag-safe reads]) With Dynamo's recursive dict tags on (torch 2.11's default), a module that reads
    its parameters from its unit's flat shard is a subtree the guards may skip while its dict is unchanged,
    as each ``nn.Linear`` of the unsharded model is (a read through a property on the class, or through a
    ``ShardedParam`` attribute, made every block one evaluated on every call): every block, and the root's
    modules, whose parameters are flats of their own. A module reading its shard itself (here the final
    norm's, frozen before sharding: its flat requires no gradient, so the read looks at the shard's) is
    not: the shard's guards, ``requires_grad`` among them, must be checked every call (an unfrozen shard
    compiles again), and that skip would skip them."""
    torch._dynamo.reset()  # the model's forward code then has this compile's cache entry only
    plain = Transformer(SMALL)
    plain.norm.weight.requires_grad_(False)
    model = shard_blocks_then_root(plain, groups)
    with torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True):
        capture(model, _tokens())
    (entry,) = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(type(model).forward.__code__)
    tag_safe = {}
    for line in str(entry.guard_manager).splitlines():
        if "GuardManager: source=" in line and "tag_safe=(" in line:
            tag_safe[line.split("source=", 1)[1].split(", ")[0]] = "tag_safe=(True" in line
    owners = {name: m for name, m in model.named_modules() if parametrize.is_parametrized(m)}
    assert len(owners) == sum(1 for m in Transformer(SMALL).modules() if next(m.parameters(False), None) is not None)
    trained = {name: all(FLATS[plan[0]].requires_grad for plan in m._fsdp_reads.values()) for name, m in owners.items()}
    assert [name for name, flat in trained.items() if not flat] == ["norm"]
    for name, flat in trained.items():
        source = "L['self']" + "".join(f"._modules['{part}']" for part in name.split("."))
        assert tag_safe[source] == flat, f"{name}: skipped whole {tag_safe[source]}, reads a trained flat {flat}"
    assert all(tag_safe[f"L['self']._modules['layers']._modules['{i}']"] for i in range(SMALL.n_layers))
