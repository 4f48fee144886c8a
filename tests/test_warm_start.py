"""Warm start (NOTE [warm start] in fsdp_compile/compiler/cache.py): AOTAutograd's cache serves what our backend
compiled, under a key that also holds our options, the ranks and our source, and is bypassed where the
user asked to see each compile.

Each test compiles a small sharded model afresh (Dynamo reset) in one fresh cache directory and reads
AOTAutograd's cache counters. The groups are made once per world: a process start makes its groups in
the same order, so they get the same names, which the markers hold, but within a process a new group
gets a new name; the gloo test in test_numerics.py (``warm-start``) checks that a second
process start of 2 ranks loads its own rank's graphs and trains exactly as the reference.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

from fsdp_compile import FsdpGroups, make_backend
from fsdp_compile._compat import structured_trace_on
from fsdp_compile.compiler import backend, cache
from fsdp_compile.compiler.backend import observe_graphs
from fsdp_compile.examples.models import Transformer, loss_fn

from .graph_utils import SMALL, fake_process_group, shard_blocks_then_root


ROOT = Path(__file__).resolve().parents[1]
_groups: list[FsdpGroups] = []


def _train_step(**backend_kw: Any) -> dict[str, int]:
    """Compile a freshly sharded SMALL model and run one step; AOTAutograd's cache counters of it."""
    torch._dynamo.reset()
    gc.collect()  # models left by earlier steps or tests, as in a new process: their flats' keys free
    counters["aot_autograd"].clear()
    torch.manual_seed(0)
    model = shard_blocks_then_root(Transformer(SMALL), _groups[-1])
    compiled = torch.compile(model, backend=make_backend(**backend_kw), fullgraph=True)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    loss_fn(compiled(tokens[:, :-1]), tokens[:, 1:]).backward()
    return {k.removeprefix("autograd_cache_"): int(v) for k, v in counters["aot_autograd"].items()
            if k.startswith("autograd_cache_")}


@contextlib.contextmanager
def _fresh_world(rank: int = 0) -> Iterator[None]:
    with fake_process_group(2, rank=rank):
        _groups.append(FsdpGroups.create())
        try:
            yield
        finally:
            _groups.pop().destroy()


def test_a_second_compile_loads_what_the_first_saved() -> None:
    with fresh_cache(), _fresh_world():
        assert _train_step() == {"miss": 1, "saved": 1}
        assert _train_step() == {"hit": 1}


def _constants_held() -> list[tuple[str, tuple[int, ...], int]]:
    """Tensor constants of the live graph modules that hold more than one element's bytes."""
    return [(name, tuple(t.shape), t.untyped_storage().nbytes()) for gm in gc.get_objects()
            if isinstance(gm, torch.fx.GraphModule) for name, t in gm.named_buffers()
            if name.startswith("_tensor_constant") and t.untyped_storage().nbytes() > t.element_size()]


def test_a_warm_start_holds_no_fill_of_the_backward() -> None:
    """NOTE [fills on reload] in partition.py: the loaded backward of an outlined block holds no zeros of an
    activation's size (the base RoPE's slices write their gradient into)."""
    with fresh_cache(), _fresh_world():
        _train_step()
        assert _train_step() == {"hit": 1}
        gc.collect()
        assert _constants_held() == []


def test_other_options_or_another_rank_compile_again() -> None:
    """Our options change the compiled graphs without changing Dynamo's graph, and so does the rank
    (the in-place all-gather writes its own slice): each must get its own entry."""
    with fresh_cache():
        with _fresh_world(rank=0):
            assert _train_step() == {"miss": 1, "saved": 1}
            assert _train_step(prefetch=0) == {"miss": 1, "saved": 1}
            assert _train_step(prefetch=0) == {"hit": 1}
        with _fresh_world(rank=1):
            assert _train_step() == {"miss": 1, "saved": 1}


def test_asking_to_see_each_compile_bypasses_the_cache(tmp_path: Any, monkeypatch: Any) -> None:
    """Observed graphs, schedule dumps, pass diffs and tlparse's trace come from a real compile, every time."""
    with fresh_cache(), _fresh_world():
        assert _train_step() == {"miss": 1, "saved": 1}
        with observe_graphs() as seen:
            assert _train_step() == {}
        assert [kind for kind, _ in seen] == ["forward", "backward"]
        assert _train_step(dump_dir=tmp_path) == {}
        assert any(tmp_path.iterdir())
        assert _train_step(log_pass_diffs=True) == {}
        with monkeypatch.context() as m:
            m.setattr(backend, "structured_trace_on", lambda: True)  # TORCH_TRACE=<dir> (the test below)
            assert _train_step() == {}
        assert _train_step() == {"hit": 1}


def test_torch_trace_is_noticed() -> None:
    """``TORCH_TRACE=<dir>``: this process writes the structured trace that tlparse reads; without it, not."""
    if not {"TORCH_TRACE", "TORCH_COMPILE_DEBUG"} & set(os.environ):
        assert not structured_trace_on()
    code = "import torch; from fsdp_compile._compat import structured_trace_on; print(structured_trace_on())"
    with tempfile.TemporaryDirectory() as trace_dir:
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TORCH_TRACE": trace_dir},
                              capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "True"


def test_the_key_covers_every_source_file_and_the_version(tmp_path: Any) -> None:
    """A pass in a sub-package of ``passes`` and a file of ``fsdp_compile/api`` are our code too: an edit
    to either, or another version, compiles again (on copies of the installed packages)."""
    roots = cache.installed_roots()
    assert [root.name for root in roots] == ["fsdp_compile", "passes"]
    copies = [Path(shutil.copytree(root, tmp_path / root.name, ignore=shutil.ignore_patterns("__pycache__")))
              for root in roots]
    before = cache.digest_sources(copies, "0.1.0")
    assert before == cache.digest_sources(roots, "0.1.0")  # what the installed packages digest to
    digests = {before}
    for edited in (tmp_path / "passes/schedule/prefetch.py", tmp_path / "fsdp_compile/api/stack.py"):
        edited.write_text(edited.read_text() + "\n# edited\n")
        digests.add(cache.digest_sources(copies, "0.1.0"))
    digests.add(cache.digest_sources(copies, "0.2.0"))
    assert len(digests) == 4
    assert cache.source_digest() == cache.digest_sources(roots, cache.installed_version())
