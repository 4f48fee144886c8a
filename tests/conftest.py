from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from fsdp_compile import FsdpGroups

from . import graph_utils

SLOW_TEST_S = 5.0  # in quiet mode, a test that takes longer gets a line: the suite's progress


@pytest.fixture
def fake_world() -> Iterator[int]:
    """A fake default process group of 2 ranks (rank 0) in this process; no real communication."""
    with graph_utils.fake_process_group(2):
        yield 2


@pytest.fixture
def groups(fake_world: int) -> Iterator[FsdpGroups]:
    g = FsdpGroups.create()
    yield g
    g.destroy()


class _Progress:
    """``pytest -q`` prints a dot per test; the multi-process tests take tens of seconds each, so a row
    of dots can sit still for minutes. After each test over ``SLOW_TEST_S`` (set-up included: that is
    where a shared spawn runs), print its time, the count done and the time so far. Under ``-n``
    (pytest-xdist) the workers' tests interleave: each test's start is kept by its id."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.total = 0
        self.done = 0
        self.suite_start = time.perf_counter()
        self.starts: dict[str, float] = {}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.total = len(session.items)
        self.suite_start = time.perf_counter()

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
        self.total = len(ids)  # (every worker collects the whole suite)

    def pytest_runtest_logstart(self, nodeid: str, location: object) -> None:
        self.starts[nodeid] = time.perf_counter()

    def pytest_runtest_logfinish(self, nodeid: str, location: object) -> None:
        self.done += 1
        now = time.perf_counter()
        took = now - self.starts.pop(nodeid, now)
        if took < SLOW_TEST_S:
            return
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"  [{self.done}/{self.total}, {now - self.suite_start:.0f} s] {nodeid}: {took:.0f} s")


def pytest_configure(config: pytest.Config) -> None:
    if config.option.verbose <= 0:  # -v already prints a line per test
        config.pluginmanager.register(_Progress(config), "fsdp_compile_progress")
