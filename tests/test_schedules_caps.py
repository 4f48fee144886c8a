"""Schedules under byte limits, pinned like ``test_schedules.py`` (same model, same listing): the caps on
bytes in flight, and which parameters keep collectives of their own (NOTE [large params alone]).
Run with ``EXPECTTEST_ACCEPT=1`` to update the snapshots after an intended change, then read the diff.
"""

from __future__ import annotations

from .graph_utils import ScheduleCase


class CapScheduleTest(ScheduleCase):
    def test_small_reduce_scatter_cap(self) -> None:
        fwd, bwd = self.schedule(reduce_scatter_bytes=300)
        # A cap of 300 B holds one 288 B bucket: each reduce-scatter is waited before the next launch.
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

    def test_large_params_alone(self) -> None:
        fwd, bwd = self.schedule(bucket_alone_bytes=200)
        # (NOTE [large params alone]) Each 256 B weight keeps an all-gather and a reduce-scatter of its own,
        # which need no pack or unpack copy (its "pack" and "unpack" are views); a 32 B bias is what is
        # left of its unit's bucket, so it is alone too. Prefetch moves a unit's collectives together: unit 1's two all-gathers are issued
        # before unit 0's compute, as its one bucket was; a unit's reduce-scatters launch as each
        # gradient is ready, and the cap ("auto": one unit in flight) pulls unit 2's waits in first.
        self.assertExpectedInline(fwd, """\
0  pack            unit 0  ag
1  all_gather      unit 0  ag     all_gather      256 B
2  pack            unit 0  ag
3  all_gather      unit 0  ag     all_gather      32 B
4  pack            unit 1  ag
5  all_gather      unit 1  ag     all_gather      256 B
6  pack            unit 1  ag
7  all_gather      unit 1  ag     all_gather      32 B
8  wait            unit 0  ag     all_gather
9  unpack          unit 0  ag
10 compute         permute  (1 nodes)
11 wait            unit 0  ag     all_gather
12 unpack          unit 0  ag
13 compute         addmm relu  (2 nodes)
14 pack            unit 2  ag
15 all_gather      unit 2  ag     all_gather      256 B
16 pack            unit 2  ag
17 all_gather      unit 2  ag     all_gather      32 B
18 wait            unit 1  ag     all_gather
19 unpack          unit 1  ag
20 compute         permute  (1 nodes)
21 wait            unit 1  ag     all_gather
22 unpack          unit 1  ag
23 compute         addmm relu  (2 nodes)
24 wait            unit 2  ag     all_gather
25 unpack          unit 2  ag
26 compute         permute  (1 nodes)
27 wait            unit 2  ag     all_gather
28 unpack          unit 2  ag
29 compute         addmm relu le  (3 nodes)""")
        self.assertExpectedInline(bwd, """\
0  pack            unit 2  ag
1  all_gather      unit 2  ag     all_gather      256 B
2  compute         where  (2 nodes)
3  pack            unit 1  ag
4  all_gather      unit 1  ag     all_gather      256 B
5  wait            unit 2  ag     all_gather
6  unpack          unit 2  ag
7  compute         mm  (5 nodes)
8  pack            unit 2  rs
9  reduce_scatter  unit 2  rs     reduce_scatter  256 B
10 compute         sum  (1 nodes)
11 pack            unit 2  rs
12 reduce_scatter  unit 2  rs     reduce_scatter  32 B
13 compute         le where  (2 nodes)
14 wait            unit 1  ag     all_gather
15 unpack          unit 1  ag
16 compute         mm  (5 nodes)
17 wait            unit 2  rs     reduce_scatter
18 wait            unit 2  rs     reduce_scatter
19 unpack          unit 2  rs
20 unpack          unit 2  rs
21 compute         view  (1 nodes)
22 unpack          unit 2  rs
23 compute         view cat  (2 nodes)
24 pack            unit 1  rs
25 reduce_scatter  unit 1  rs     reduce_scatter  256 B
26 compute         sum  (1 nodes)
27 pack            unit 1  rs
28 reduce_scatter  unit 1  rs     reduce_scatter  32 B
29 compute         le where mm  (4 nodes)
30 wait            unit 1  rs     reduce_scatter
31 wait            unit 1  rs     reduce_scatter
32 unpack          unit 1  rs
33 unpack          unit 1  rs
34 compute         view  (1 nodes)
35 unpack          unit 1  rs
36 compute         view cat  (2 nodes)
37 pack            unit 0  rs
38 reduce_scatter  unit 0  rs     reduce_scatter  256 B
39 compute         sum  (1 nodes)
40 pack            unit 0  rs
41 reduce_scatter  unit 0  rs     reduce_scatter  32 B
42 wait            unit 0  rs     reduce_scatter
43 wait            unit 0  rs     reduce_scatter
44 unpack          unit 0  rs
45 compute         view  (1 nodes)
46 unpack          unit 0  rs
47 compute         view cat  (2 nodes)""")

    def test_small_prefetch_cap(self) -> None:
        fwd, bwd = self.schedule(prefetch=2, prefetch_bytes=600)
        # Depth 2 asked, but 600 B holds two 288 B gathered buckets: unit 2 is issued one unit ahead.
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
