"""benchmarks.scan_probe's ``--host-counters`` (NOTE [lean C++ for a GPU loop] there), which is the
backend's own swap (NOTE [loop counters off the C++ path] in fsdp_compile/_compat_loops.py): the decomposed
scan's counter runs as our ops, in forward and backward, the numbers stay those of the uncompiled loop,
and the patch of torch's decomposition is undone on leaving."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._inductor.fx_passes.post_grad as post_grad

from benchmarks import scan_probe
from fsdp_compile import _compat_loops


def test_option_checks() -> None:
    for flags in (["--lean-cpp"], ["--no-pch"], ["--gather-world1"]):
        with pytest.raises(SystemExit):
            scan_probe.parse_args(flags)  # CPU runs: refused, each with the reason
    assert scan_probe.parse_args(["--host-counters"]).host_counters  # CPU too: the counter is host-side there


def test_host_counters_keep_the_loss_and_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    rewritten: list[list[str]] = []
    rewrite = _compat_loops.rewrite_loop_counters
    depth = [0]

    def spy(gm: Any) -> None:  # the rewrite recurses into loop bodies: record the whole graphs only
        depth[0] += 1
        try:
            rewrite(gm)
        finally:
            depth[0] -= 1
        if depth[0]:
            return
        targets: list[str] = []
        for m in gm.modules():
            if isinstance(m, torch.fx.GraphModule):
                targets += [str(n.target) for n in m.graph.nodes if "fsdp_loop" in str(n.target)]
        rewritten.append(targets)

    monkeypatch.setattr(_compat_loops, "rewrite_loop_counters", spy)
    torch.manual_seed(0)
    model = scan_probe._stack(2, 16, 2, 32, "scan")
    loop = scan_probe._stack(2, 16, 2, 32, "loop")
    loop.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 32, (1, 8), generator=torch.Generator().manual_seed(1))
    decompose = post_grad.decompose_scan_to_while_loop
    torch._dynamo.reset()
    no_cache = torch._inductor.config.patch(fx_graph_cache=False)  # the decomposition runs, not a cached graph
    with no_cache, torch._functorch.config.patch(enable_autograd_cache=False), scan_probe.host_counters():
        loss = torch.compile(model, fullgraph=True)(tokens).float().logsumexp(-1).mean()
        loss.backward()
    assert post_grad.decompose_scan_to_while_loop is decompose
    expected = loop(tokens).float().logsumexp(-1).mean()
    expected.backward()
    ops = [f"fsdp_loop.{op}.default" for op in ("start", "below", "next")]
    # Inductor decomposes each graph it compiles, bodies first: the forward's and the backward's loops
    loops = [t for t in rewritten if t]
    assert len(loops) == 2 and all(sorted(t) == sorted(ops) for t in loops), rewritten
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), loop.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
