"""Ranks that diverge while a peer is already inside a collective raise on every rank in bounded time
with the process group's default timeout (30 min on gloo): a peer's heartbeat says which graph call it
is inside (NOTE [peers]), so the rank waiting in a check names it after ``STUCK_S``, and the blocked
rank's collective fails as that rank exits, its note quoting the first (NOTE [heard failures])."""

from __future__ import annotations

import re

import pytest

from fsdp_compile.examples.launch import RankFailure, run_ranks

from .divergence_workers import diverging_forwards
from .misuse_workers import rank_text, seconds

DEFAULT_PG_TIMEOUT_S = 1800.0  # gloo's default
ALLOWED_S = 60.0


@pytest.mark.parametrize("case, waiting, inside", [
    ("skip-block", "rank 0 waits for its peers to compile a forward graph with 2 collectives",
     "rank 1 has been inside graph call #5, a forward graph with 3 collectives"),
    ("grad-vs-no-grad", "rank 1 waits for its peers to run an inference graph with 3 collectives",
     "rank 0 has been inside graph call #8, a forward graph with 3 collectives"),
], ids=["skip-block", "grad-vs-no-grad"])
def test_diverging_ranks_raise_within_a_minute_by_default(case: str, waiting: str, inside: str) -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(diverging_forwards, 2, case, {}, pg_timeout_s=DEFAULT_PG_TIMEOUT_S, timeout=ALLOWED_S + 120,
                  grace_s=ALLOWED_S)
    for rank in (0, 1):
        text = rank_text(info.value, rank)
        assert seconds(text) <= ALLOWED_S, text
        assert waiting in text and inside in text, text  # both ranks, and what each ran
        assert "some ranks only" in text, text


def test_a_set_agreement_timeout_is_named_as_such() -> None:
    """Rank 1 sleeps outside any graph (alive, never comes): rank 0 waits ``agreement_timeout_s``."""
    with pytest.raises(RankFailure) as info:
        run_ranks(diverging_forwards, 2, "idle", {"agreement_timeout_s": 3.0}, pg_timeout_s=DEFAULT_PG_TIMEOUT_S,
                  timeout=150)
    text = rank_text(info.value, 0)
    assert re.search(r"waited \d+ s \(agreement_timeout_s\) for ranks \[1\]", text), text
    assert "process group's timeout" not in text, text
