"""When each surviving rank raises, and what it says, for issue 12's hang cases, at a chosen process-group
timeout (default 60 s, as the issue tried them), on 2 gloo ranks.

    python -m benchmarks.misuse_timings [--pg-timeout 60]

Cases (tests/misuse_workers.py): a rank raises before its first forward; a rank is killed then (no word,
its heartbeat stops); rank 0, which hosts the store, is killed then; an evaluation on rank 0 only while
rank 1 trains on, first when the inference graph is new and then after every rank ran one. The target:
every surviving rank raises within the timeout + 30 s, naming the rank and the mistake.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from fsdp_compile.launch import RankFailure, run_ranks
from tests.misuse_workers import forward_on_rank_zero_only, peer_fails_before_first_forward

CASES: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
    ("rank 1 raises", peer_fails_before_first_forward, (1, "raise")),
    ("rank 1 killed", peer_fails_before_first_forward, (1, "exit")),
    ("rank 0 killed", peer_fails_before_first_forward, (0, "exit")),
    ("eval on rank 0 only, first", forward_on_rank_zero_only, (False,)),
    ("eval on rank 0 only, after one on all", forward_on_rank_zero_only, (True,)),
]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pg-timeout", type=float, default=60.0)
    ns = p.parse_args(argv)
    rows = []
    for name, fn, args in CASES:
        start = time.monotonic()
        try:
            run_ranks(fn, 2, *args, pg_timeout_s=ns.pg_timeout, timeout=ns.pg_timeout + 300, grace_s=ns.pg_timeout + 40)
            rows.append((name, "-", "-", "no rank raised"))
            continue
        except RankFailure as e:
            for part in re.split(r"^--- ", str(e), flags=re.M)[1:]:
                after = re.search(r"\[after ([0-9.]+) s\]", part)
                if after is None:
                    continue  # the rank that failed on purpose
                said = next((line.strip() for line in part.splitlines() if "fsdp_compile:" in line), "")
                rows.append((name, part.split(" raised")[0], after.group(1), said[:160].replace("|", "/")))
        print(f"{name}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    print(f"process-group timeout {ns.pg_timeout:.0f} s; target: within {ns.pg_timeout + 30:.0f} s\n")
    print("| case | surviving rank | raised after s | says |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
