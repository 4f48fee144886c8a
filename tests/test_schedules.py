"""Schedules, pinned: forward and backward of a 3-unit model at world size 2 on a fake process group.

Each test compiles ``ThreeUnits`` (three ``Linear(8, 8)`` blocks, each its own unit; the root holds no
params) and snapshots the compact listing of the graphs handed to Inductor. Group names are replaced
by labels: ``ag`` (all-gather group), ``rs`` (reduce-scatter group), ``ag+rs`` (one shared group).
Run with ``EXPECTTEST_ACCEPT=1`` to update the snapshots after an intended change, then read the diff.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from fsdp_compile import FsdpGroups, MixedPrecisionPolicy
from fsdp_compile.inspection.schedule import group_labels, listing

from .graph_utils import FakeWorldTestCase, ScheduleCase, ThreeUnits, capture, shard_blocks_then_root


class ScheduleTest(ScheduleCase):

    def test_default(self) -> None:
        fwd, bwd = self.schedule()
        # Forward: unit 1's all-gather is issued before unit 0's compute (prefetch 1) and each wait sits
        # just before its unit's compute; the all-gathers run on the all-gather stream.
        self.assertExpectedInline(fwd, """\
0  all_gather      unit 0  ag     all_gather      288 B
1  all_gather      unit 1  ag     all_gather      288 B
2  wait            unit 0  ag     all_gather
3  unpack          unit 0  ag
4  compute         addmm relu  (3 nodes)
5  all_gather      unit 2  ag     all_gather      288 B
6  wait            unit 1  ag     all_gather
7  unpack          unit 1  ag
8  compute         addmm relu  (3 nodes)
9  wait            unit 2  ag     all_gather
10 unpack          unit 2  ag
11 compute         addmm relu le  (4 nodes)""")
        # Backward: the gathers again (reshard after forward; unit 0's weight is not needed: its input
        # needs no grad), unit 2's before the graph's first compute, unit 1 prefetched under unit 2's compute. Each reduce-scatter is issued right
        # after the unit's last gradient, on its own stream; with the default cap (one unit in flight:
        # NOTE [one unit in flight]) each is waited just before the next unit's pack.
        self.assertExpectedInline(bwd, """\
0  pack            unit 2  ag
1  all_gather      unit 2  ag     all_gather      256 B
2  compute         where  (2 nodes)
3  pack            unit 1  ag
4  all_gather      unit 1  ag     all_gather      256 B
5  wait            unit 2  ag     all_gather
6  unpack          unit 2  ag
7  compute         mm sum  (6 nodes)
8  pack            unit 2  rs
9  reduce_scatter  unit 2  rs     reduce_scatter  288 B
10 compute         le where  (2 nodes)
11 wait            unit 1  ag     all_gather
12 unpack          unit 1  ag
13 compute         mm sum  (6 nodes)
14 wait            unit 2  rs     reduce_scatter
15 unpack          unit 2  rs
16 pack            unit 1  rs
17 reduce_scatter  unit 1  rs     reduce_scatter  288 B
18 compute         le where mm sum  (5 nodes)
19 wait            unit 1  rs     reduce_scatter
20 unpack          unit 1  rs
21 pack            unit 0  rs
22 reduce_scatter  unit 0  rs     reduce_scatter  288 B
23 wait            unit 0  rs     reduce_scatter
24 unpack          unit 0  rs""")

    def test_delayed_one_communicator(self) -> None:
        fwd, bwd = self.schedule(dedicated="none", schedule="delayed")
        # The seed's baseline: one communicator ("comm" stream). Unit 2's reduce-scatter is held until
        # unit 1's backward begins (after unit 1's all-gather was waited); the others go to the end.
        self.assertExpectedInline(bwd, """\
0  pack            unit 2  ag+rs
1  all_gather      unit 2  ag+rs  comm            256 B
2  compute         where  (2 nodes)
3  pack            unit 1  ag+rs
4  all_gather      unit 1  ag+rs  comm            256 B
5  wait            unit 2  ag+rs  comm
6  unpack          unit 2  ag+rs
7  compute         mm sum le where  (8 nodes)
8  wait            unit 1  ag+rs  comm
9  unpack          unit 1  ag+rs
10 pack            unit 2  ag+rs
11 reduce_scatter  unit 2  ag+rs  comm            288 B
12 compute         mm sum le where  (11 nodes)
13 wait            unit 2  ag+rs  comm
14 unpack          unit 2  ag+rs
15 pack            unit 1  ag+rs
16 reduce_scatter  unit 1  ag+rs  comm            288 B
17 wait            unit 1  ag+rs  comm
18 unpack          unit 1  ag+rs
19 pack            unit 0  ag+rs
20 reduce_scatter  unit 0  ag+rs  comm            288 B
21 wait            unit 0  ag+rs  comm
22 unpack          unit 0  ag+rs""")

    def test_dedicated_all_gather(self) -> None:
        fwd, bwd = self.schedule(dedicated="all_gather")
        # The other convention: the all-gathers get the dedicated group (still "ag"), reduce-scatters
        # stay on the base group ("rs"); the schedule is the same as the default.
        self.assertExpectedInline(bwd, """\
0  pack            unit 2  ag
1  all_gather      unit 2  ag     all_gather      256 B
2  compute         where  (2 nodes)
3  pack            unit 1  ag
4  all_gather      unit 1  ag     all_gather      256 B
5  wait            unit 2  ag     all_gather
6  unpack          unit 2  ag
7  compute         mm sum  (6 nodes)
8  pack            unit 2  rs
9  reduce_scatter  unit 2  rs     reduce_scatter  288 B
10 compute         le where  (2 nodes)
11 wait            unit 1  ag     all_gather
12 unpack          unit 1  ag
13 compute         mm sum  (6 nodes)
14 wait            unit 2  rs     reduce_scatter
15 unpack          unit 2  rs
16 pack            unit 1  rs
17 reduce_scatter  unit 1  rs     reduce_scatter  288 B
18 compute         le where mm sum  (5 nodes)
19 wait            unit 1  rs     reduce_scatter
20 unpack          unit 1  rs
21 pack            unit 0  rs
22 reduce_scatter  unit 0  rs     reduce_scatter  288 B
23 wait            unit 0  rs     reduce_scatter
24 unpack          unit 0  rs""")

    def test_prefetch_0(self) -> None:
        fwd, bwd = self.schedule(prefetch=0)
        # No prefetch: every all-gather is issued right before its wait: nothing overlaps it.
        self.assertExpectedInline(fwd, """\
0  all_gather      unit 0  ag     all_gather      288 B
1  wait            unit 0  ag     all_gather
2  unpack          unit 0  ag
3  compute         addmm relu  (3 nodes)
4  all_gather      unit 1  ag     all_gather      288 B
5  wait            unit 1  ag     all_gather
6  unpack          unit 1  ag
7  compute         addmm relu  (3 nodes)
8  all_gather      unit 2  ag     all_gather      288 B
9  wait            unit 2  ag     all_gather
10 unpack          unit 2  ag
11 compute         addmm relu le  (4 nodes)""")
        self.assertExpectedInline(bwd, """\
0  compute         where  (2 nodes)
1  pack            unit 2  ag
2  all_gather      unit 2  ag     all_gather      256 B
3  wait            unit 2  ag     all_gather
4  unpack          unit 2  ag
5  compute         mm sum  (6 nodes)
6  pack            unit 2  rs
7  reduce_scatter  unit 2  rs     reduce_scatter  288 B
8  compute         le where  (2 nodes)
9  pack            unit 1  ag
10 all_gather      unit 1  ag     all_gather      256 B
11 wait            unit 1  ag     all_gather
12 unpack          unit 1  ag
13 compute         mm sum  (6 nodes)
14 wait            unit 2  rs     reduce_scatter
15 unpack          unit 2  rs
16 pack            unit 1  rs
17 reduce_scatter  unit 1  rs     reduce_scatter  288 B
18 compute         le where mm sum  (5 nodes)
19 wait            unit 1  rs     reduce_scatter
20 unpack          unit 1  rs
21 pack            unit 0  rs
22 reduce_scatter  unit 0  rs     reduce_scatter  288 B
23 wait            unit 0  rs     reduce_scatter
24 unpack          unit 0  rs""")

    def test_prefetch_2(self) -> None:
        fwd, bwd = self.schedule(prefetch=2)
        # Depth 2: all three forward all-gathers are issued before unit 0's compute.
        self.assertExpectedInline(fwd, """\
0  all_gather      unit 0  ag     all_gather      288 B
1  all_gather      unit 1  ag     all_gather      288 B
2  all_gather      unit 2  ag     all_gather      288 B
3  wait            unit 0  ag     all_gather
4  unpack          unit 0  ag
5  compute         addmm relu  (3 nodes)
6  wait            unit 1  ag     all_gather
7  unpack          unit 1  ag
8  compute         addmm relu  (3 nodes)
9  wait            unit 2  ag     all_gather
10 unpack          unit 2  ag
11 compute         addmm relu le  (4 nodes)""")
        self.assertExpectedInline(bwd, """\
0  pack            unit 2  ag
1  all_gather      unit 2  ag     all_gather      256 B
2  pack            unit 1  ag
3  all_gather      unit 1  ag     all_gather      256 B
4  compute         where  (2 nodes)
5  wait            unit 2  ag     all_gather
6  unpack          unit 2  ag
7  compute         mm sum  (6 nodes)
8  pack            unit 2  rs
9  reduce_scatter  unit 2  rs     reduce_scatter  288 B
10 compute         le where  (2 nodes)
11 wait            unit 1  ag     all_gather
12 unpack          unit 1  ag
13 compute         mm sum  (6 nodes)
14 wait            unit 2  rs     reduce_scatter
15 unpack          unit 2  rs
16 pack            unit 1  rs
17 reduce_scatter  unit 1  rs     reduce_scatter  288 B
18 compute         le where mm sum  (5 nodes)
19 wait            unit 1  rs     reduce_scatter
20 unpack          unit 1  rs
21 pack            unit 0  rs
22 reduce_scatter  unit 0  rs     reduce_scatter  288 B
23 wait            unit 0  rs     reduce_scatter
24 unpack          unit 0  rs""")

    def test_mixed_precision_casts_before_all_gather(self) -> None:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fwd, bwd = self.schedule(shard_kw={"mp_policy": mp})
        # bf16 params: each "pack" casts the fp32 shards to bf16 *before* the all-gather, which moves
        # half the bytes (144 B, not 288 B); gradients are reduce-scattered in fp32 (288 B).
        self.assertExpectedInline(fwd, """\
0  pack            unit 0  ag
1  all_gather      unit 0  ag     all_gather      144 B
2  pack            unit 1  ag
3  all_gather      unit 1  ag     all_gather      144 B
4  wait            unit 0  ag     all_gather
5  unpack          unit 0  ag
6  compute         addmm relu  (3 nodes)
7  pack            unit 2  ag
8  all_gather      unit 2  ag     all_gather      144 B
9  wait            unit 1  ag     all_gather
10 unpack          unit 1  ag
11 compute         addmm relu  (3 nodes)
12 wait            unit 2  ag     all_gather
13 unpack          unit 2  ag
14 compute         addmm relu le  (4 nodes)""")
        self.assertExpectedInline(bwd, """\
0  pack            unit 2  ag
1  all_gather      unit 2  ag     all_gather      128 B
2  compute         where  (2 nodes)
3  pack            unit 1  ag
4  all_gather      unit 1  ag     all_gather      128 B
5  wait            unit 2  ag     all_gather
6  unpack          unit 2  ag
7  compute         mm sum  (6 nodes)
8  pack            unit 2  rs
9  reduce_scatter  unit 2  rs     reduce_scatter  288 B
10 compute         le where  (2 nodes)
11 wait            unit 1  ag     all_gather
12 unpack          unit 1  ag
13 compute         mm sum  (6 nodes)
14 wait            unit 2  rs     reduce_scatter
15 unpack          unit 2  rs
16 pack            unit 1  rs
17 reduce_scatter  unit 1  rs     reduce_scatter  288 B
18 compute         le where mm sum  (5 nodes)
19 wait            unit 1  rs     reduce_scatter
20 unpack          unit 1  rs
21 pack            unit 0  rs
22 reduce_scatter  unit 0  rs     reduce_scatter  288 B
23 wait            unit 0  rs     reduce_scatter
24 unpack          unit 0  rs""")

    def test_reshard_after_forward_false(self) -> None:
        fwd, bwd = self.schedule(shard_kw={"reshard_after_forward": False})
        # The gathered params are kept from forward to backward: backward has no all-gather at all,
        # only the three reduce-scatters.
        self.assertExpectedInline(bwd, """\
0  compute         where mm sum  (6 nodes)
1  pack            unit 2  rs
2  reduce_scatter  unit 2  rs     reduce_scatter  288 B
3  compute         le where mm sum  (6 nodes)
4  wait            unit 2  rs     reduce_scatter
5  unpack          unit 2  rs
6  pack            unit 1  rs
7  reduce_scatter  unit 1  rs     reduce_scatter  288 B
8  compute         le where mm sum  (5 nodes)
9  wait            unit 1  rs     reduce_scatter
10 unpack          unit 1  rs
11 pack            unit 0  rs
12 reduce_scatter  unit 0  rs     reduce_scatter  288 B
13 wait            unit 0  rs     reduce_scatter
14 unpack          unit 0  rs""")

    def test_no_sync(self) -> None:
        fwd, bwd = self.schedule(no_sync=True)
        # set_requires_gradient_sync(False): the forward is unchanged (each unit's flat gathered as it is,
        # NOTE [no-sync]), the backward has no reduce-scatter: full gradients go to local accumulation
        # leaves (reduced once, later).
        self.assertEqual(fwd, self.schedule()[0])
        self.assertExpectedInline(bwd, """\
0  pack            unit 2  ag
1  all_gather      unit 2  ag     all_gather      256 B
2  compute         where  (2 nodes)
3  pack            unit 1  ag
4  all_gather      unit 1  ag     all_gather      256 B
5  wait            unit 2  ag     all_gather
6  unpack          unit 2  ag
7  compute         mm sum le where  (9 nodes)
8  wait            unit 1  ag     all_gather
9  unpack          unit 1  ag
10 compute         mm sum le where  (13 nodes)""")


class HsdpScheduleTest(FakeWorldTestCase):
    world_size = 4

    def test_hsdp_2x2(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        groups = FsdpGroups.create(mesh)
        torch.manual_seed(0)
        graphs = capture(shard_blocks_then_root(ThreeUnits(), groups), torch.randn(4, 8))
        # HSDP on (replicate 2, shard 2): each unit's reduce-scatter (on "rs", shard dimension) is
        # followed by one bucketed all-reduce across replicas ("rep"), launched as soon as the
        # reduce-scatter's wait (pulled in before the next unit's launch); their waits sink to the end.
        self.assertExpectedInline(listing(graphs["backward"], group_labels(groups)), """\
0  pack            unit 2  ag
1  all_gather      unit 2  ag     all_gather      256 B
2  compute         where  (2 nodes)
3  pack            unit 1  ag
4  all_gather      unit 1  ag     all_gather      256 B
5  wait            unit 2  ag     all_gather
6  unpack          unit 2  ag
7  compute         mm sum  (6 nodes)
8  pack            unit 2  rs
9  reduce_scatter  unit 2  rs     reduce_scatter  288 B
10 compute         le where  (2 nodes)
11 wait            unit 1  ag     all_gather
12 unpack          unit 1  ag
13 compute         mm sum  (6 nodes)
14 wait            unit 2  rs     reduce_scatter
15 all_reduce      unit 2  rep    replicate       144 B
16 pack            unit 1  rs
17 reduce_scatter  unit 1  rs     reduce_scatter  288 B
18 compute         le where mm sum  (5 nodes)
19 wait            unit 1  rs     reduce_scatter
20 all_reduce      unit 1  rep    replicate       144 B
21 pack            unit 0  rs
22 reduce_scatter  unit 0  rs     reduce_scatter  288 B
23 wait            unit 0  rs     reduce_scatter
24 all_reduce      unit 0  rep    replicate       144 B
25 wait            unit 2  rep    replicate
26 wait            unit 1  rep    replicate
27 wait            unit 0  rep    replicate
28 unpack          unit 2  rep
29 unpack          unit 1  rep
30 unpack          unit 0  rep""")
