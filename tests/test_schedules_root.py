"""Schedules of a root unit whose parameters are read at both ends of backward (NOTE [gradients in
stretches] in ``passes/lower/markers.py``): an embedding before the blocks, a head (and a final norm) after.

Snapshots as in ``test_schedules.py``: a fake process group of world size 2, group names as labels.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_compile import FsdpGroups, MixedPrecisionPolicy
from fsdp_compile.inspection.schedule import group_labels, listing

from .graph_utils import FakeWorldTestCase, capture, shard_blocks_then_root


class EmbeddingAndHead(nn.Module):
    """An embedding, two linear blocks and an output head: the root's parameters are read at both ends."""

    def __init__(self, width: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def backward_listing(model: nn.Module) -> str:
    """``model``'s blocks and root sharded under bf16 compute with fp32 reduction; its backward's listing."""
    groups = FsdpGroups.create(dedicated="reduce_scatter")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    sharded = shard_blocks_then_root(model, groups, mp_policy=mp)
    return listing(capture(sharded, torch.randint(0, 16, (4,)))["backward"], group_labels(groups))


class RootAtBothEndsTest(FakeWorldTestCase):

    def test_each_stretch_of_the_root_s_gradients_is_reduced_when_it_exists(self) -> None:
        bwd = backward_listing(EmbeddingAndHead())
        # (NOTE [gradients in stretches]) the root (unit 2) has two reduce-scatters, each cast to fp32: its
        # head's, right after the head's weight gradient at the start of backward (it runs under the blocks'
        # backward and is waited before unit 1's pack), and its embedding's at the end.
        self.assertExpectedInline(bwd, """\
0  pack            unit 2  ag
1  all_gather      unit 2  ag     all_gather      256 B
2  compute         mm  (2 nodes)
3  pack            unit 2  rs
4  reduce_scatter  unit 2  rs     reduce_scatter  512 B
5  pack            unit 1  ag
6  all_gather      unit 1  ag     all_gather      128 B
7  wait            unit 2  ag     all_gather
8  unpack          unit 2  ag
9  compute         mm le where  (6 nodes)
10 pack            unit 0  ag
11 all_gather      unit 0  ag     all_gather      128 B
12 wait            unit 1  ag     all_gather
13 unpack          unit 1  ag
14 compute         mm sum  (6 nodes)
15 wait            unit 2  rs     reduce_scatter
16 unpack          unit 2  rs
17 compute         view  (1 nodes)
18 pack            unit 1  rs
19 reduce_scatter  unit 1  rs     reduce_scatter  288 B
20 compute         le where  (2 nodes)
21 wait            unit 0  ag     all_gather
22 unpack          unit 0  ag
23 compute         mm sum  (6 nodes)
24 wait            unit 1  rs     reduce_scatter
25 unpack          unit 1  rs
26 pack            unit 0  rs
27 reduce_scatter  unit 0  rs     reduce_scatter  288 B
28 compute         ge lt bitwise_and ne _unsafe_masked_index_put_accumulate  (10 nodes)
29 wait            unit 0  rs     reduce_scatter
30 unpack          unit 0  rs
31 pack            unit 2  rs
32 reduce_scatter  unit 2  rs     reduce_scatter  512 B
33 wait            unit 2  rs     reduce_scatter
34 unpack          unit 2  rs
35 compute         view  (1 nodes)""")


class EmbeddingNormAndHead(EmbeddingAndHead):
    """``EmbeddingAndHead`` with a final RMS norm before the head: the norm's weight gradient needs the
    head's gathered weight (through the gradient of the norm's output), the head's weight gradient does not."""

    def __init__(self, width: int = 8, vocab: int = 16) -> None:
        super().__init__(width, vocab)
        self.norm = nn.RMSNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(self.norm(x))


class RootWithNormTest(FakeWorldTestCase):

    def test_the_head_s_gradient_is_reduced_before_the_head_s_gather_is_waited(self) -> None:
        bwd = backward_listing(EmbeddingNormAndHead())
        # The root (unit 2) reduces three stretches: the head's weight gradient (512 B) right after its
        # matmul, before the wait for the root's gather (the head's weight, for the gradient of the norm's
        # output); the norm's weight (32 B) once that exists; the embedding's at the end. In one bucket
        # with the norm, the head's reduce-scatter would wait for the gather and the matmul after it.
        self.assertExpectedInline(bwd, """\
0  pack            unit 2  ag
1  all_gather      unit 2  ag     all_gather      272 B
2  compute         mm  (2 nodes)
3  pack            unit 2  rs
4  reduce_scatter  unit 2  rs     reduce_scatter  512 B
5  pack            unit 1  ag
6  all_gather      unit 1  ag     all_gather      128 B
7  wait            unit 2  ag     all_gather
8  unpack          unit 2  ag
9  compute         mm relu mul sum  (12 nodes)
10 pack            unit 2  rs
11 reduce_scatter  unit 2  rs     reduce_scatter  32 B
12 compute         mul sum pow div add le where  (16 nodes)
13 pack            unit 0  ag
14 all_gather      unit 0  ag     all_gather      128 B
15 wait            unit 1  ag     all_gather
16 unpack          unit 1  ag
17 compute         mm sum  (6 nodes)
18 wait            unit 2  rs     reduce_scatter
19 wait            unit 2  rs     reduce_scatter
20 unpack          unit 2  rs
21 unpack          unit 2  rs
22 unpack          unit 2  rs
23 compute         view  (1 nodes)
24 pack            unit 1  rs
25 reduce_scatter  unit 1  rs     reduce_scatter  288 B
26 compute         le where  (2 nodes)
27 wait            unit 0  ag     all_gather
28 unpack          unit 0  ag
29 compute         mm sum  (6 nodes)
30 wait            unit 1  rs     reduce_scatter
31 unpack          unit 1  rs
32 pack            unit 0  rs
33 reduce_scatter  unit 0  rs     reduce_scatter  288 B
34 compute         ge lt bitwise_and ne _unsafe_masked_index_put_accumulate  (10 nodes)
35 wait            unit 0  rs     reduce_scatter
36 unpack          unit 0  rs
37 pack            unit 2  rs
38 reduce_scatter  unit 2  rs     reduce_scatter  512 B
39 wait            unit 2  rs     reduce_scatter
40 unpack          unit 2  rs
41 compute         view  (1 nodes)""")
