"""Rank functions for tests/test_misuse.py: each runs a mistake (or a corner) a new user hits.

A rank that is expected to fail re-raises with how long it took, ``[after 12.3 s] ...``, and the full
text of the error (notes included), so the test can check both what it says and that it came in time.
"""

from __future__ import annotations

import math
import os
import re
import signal
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._dynamo.utils import counters

from fsdp_compile import FsdpGroups, local_shard, make_backend
from fsdp_compile.examples.models import Transformer, loss_fn

from .workers import TINY, UnevenModel, make_optimizer, shard_model


class Timed(RuntimeError):
    """Raised by a rank to report an expected error and when it came."""


def timed(start: float, error: BaseException) -> Timed:
    """``error`` as a :class:`Timed`: its text, after how long since ``start`` it came."""
    text = "".join(traceback.format_exception_only(type(error), error))
    return Timed(f"[after {time.monotonic() - start:.1f} s] {text}")


def rank_text(failure: Exception, rank: int) -> str:
    """What ``rank`` raised, from a ``RankFailure`` of ``run_ranks``."""
    parts = re.split(r"^--- ", str(failure), flags=re.M)
    found = [p for p in parts if p.startswith(f"rank {rank} raised")]
    assert found, f"rank {rank} did not raise:\n{failure}"
    return found[0]


def seconds(text: str) -> float:
    """After how long a :class:`Timed` error came."""
    match = re.search(r"\[after ([0-9.]+) s\]", text)
    assert match, text
    return float(match.group(1))


def _tokens(seed: int, batch: int, seq: int, vocab: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _step(compiled: Any, opt: torch.optim.Optimizer, ref: nn.Module, ref_opt: torch.optim.Optimizer,
          batches: list[tuple[Tensor, Tensor]], rank: int, world: int) -> tuple[float, float]:
    """One step sharded on this rank's batch and one unsharded on all of them (FSDP averages the ranks'
    gradients, so the reference averages their losses): (global mean loss, reference loss)."""
    x, y = batches[rank]
    loss = loss_fn(compiled(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    ref_loss = sum(loss_fn(ref(bx), by) for bx, by in batches) / world
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return total.item() / world, ref_loss.item()


# ---------------------------------------------------------------------------------------------
# Gradient clipping and other norms over sharded gradients
# ---------------------------------------------------------------------------------------------


def _norms(params: list[nn.Parameter]) -> dict[str, Any]:
    grads = [p.grad for p in params if p.grad is not None]
    return {
        "total": torch.nn.utils.get_total_norm(grads).item(),
        "total_no_foreach": torch.nn.utils.get_total_norm(grads, foreach=False).item(),
        "inf": torch.nn.utils.get_total_norm(grads, norm_type=math.inf).item(),
        "minus_inf": torch.nn.utils.get_total_norm(grads, norm_type=-math.inf).item(),
        "l1": torch.nn.utils.get_total_norm(grads, norm_type=1.0).item(),
        "per_param": [g.norm().item() for g in grads],
        "fro": [torch.linalg.matrix_norm(g).item() for g in grads if g.dim() == 2],
    }


def clip_training(rank: int, world: int, steps: int, max_norm: float, device: str = "cpu",
                  backend_kw: dict[str, Any] | None = None) -> dict[str, Any]:
    """Uneven shards (vocab 1001, width 10), the standard clip call every step; and the same training
    unsharded in this process on all ranks' batches."""
    groups = FsdpGroups.create()
    torch.manual_seed(0)
    model = shard_model(UnevenModel().to(device), groups)
    compiled = torch.compile(model, backend=make_backend(**(backend_kw or {"inductor": False})))
    opt = make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    torch.manual_seed(0)
    ref = UnevenModel().to(device)
    ref_opt = make_optimizer("adamw", [p for p in ref.parameters() if p.requires_grad])
    out: dict[str, Any] = {"losses": [], "ref_losses": [], "clipped": [], "ref_clipped": [], "norms": [],
                           "ref_norms": []}
    for step in range(steps):
        batches = [tuple(t.to(device) for t in _tokens(100 * step + r, 2, 6, 1001)) for r in range(world)]
        x, y = batches[rank]
        loss = loss_fn(compiled(x), y)
        loss.backward()
        params = [p for p in model.parameters() if p.requires_grad]
        out["norms"].append(_norms(params))
        if step == 0:
            try:
                torch.linalg.matrix_norm(next(p.grad for p in params if p.dim() == 2), "nuc")
            except ValueError as e:
                out["nuclear"] = str(e)
        out["clipped"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out["losses"].append(total.item() / world)

        ref_loss = sum(loss_fn(ref(bx), by) for bx, by in batches) / world
        ref_loss.backward()
        ref_params = [p for p in ref.parameters() if p.requires_grad]
        out["ref_norms"].append(_norms(ref_params))
        out["ref_clipped"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item())
        ref_opt.step()
        ref_opt.zero_grad()
        out["ref_losses"].append(ref_loss.item())
    groups.destroy()
    return out


# ---------------------------------------------------------------------------------------------
# Sequence lengths that differ per rank (padding per batch): ranks recompile at different steps
# ---------------------------------------------------------------------------------------------

RAGGED = {0: [6, 6, 5, 4], 1: [6, 5, 5, 4]}


def ragged_lengths(rank: int, world: int, backend_kw: dict[str, Any]) -> dict[str, Any]:
    groups = FsdpGroups.create()
    torch.manual_seed(0)
    model = shard_model(Transformer(TINY), groups)
    compiled = torch.compile(model, backend=make_backend(**backend_kw))
    opt = make_optimizer("adamw", model.parameters())
    torch.manual_seed(0)
    ref = Transformer(TINY)
    ref_opt = make_optimizer("adamw", ref.parameters())
    losses, ref_losses = [], []
    for step in range(len(RAGGED[0])):
        batches = [_tokens(10 * step + r, 2, RAGGED[r][step], TINY.vocab_size) for r in range(world)]
        loss, ref_loss = _step(compiled, opt, ref, ref_opt, batches, rank, world)
        losses.append(loss)
        ref_losses.append(ref_loss)
    groups.destroy()
    return {"losses": losses, "ref_losses": ref_losses}


# ---------------------------------------------------------------------------------------------
# A peer that fails, and forwards run on some ranks only
# ---------------------------------------------------------------------------------------------


def _tiny_model(groups: FsdpGroups, inductor: bool = False) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = shard_model(Transformer(TINY), groups)
    return model, torch.compile(model, backend=make_backend(inductor=inductor))


def _train_step(compiled: Any, step: int) -> None:
    x, y = _tokens(step, 2, 6, TINY.vocab_size)
    loss_fn(compiled(x), y).backward()


def peer_fails_before_first_forward(rank: int, world: int, victim: int, how: str) -> None:
    """``victim`` raises (``how="raise"``) or dies without a word (``how="exit"``: exit code 3;
    ``how="kill"``: SIGKILL, as the out-of-memory killer does) after sharding; the others start
    training and must name it."""
    groups = FsdpGroups.create()
    _, compiled = _tiny_model(groups)
    if rank == victim:
        if how == "exit":
            os._exit(3)  # no exception, no note, the heartbeat just stops
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("the data loader of this rank broke")
    start = time.monotonic()
    try:
        _train_step(compiled, 0)
    except Exception as e:
        raise timed(start, e) from e


def crashes_once(rank: int, world: int, marker: str, how: str) -> int:
    """Rank 0 dies the first time (``marker`` does not exist yet): of SIGKILL (``how="kill"``), or as glibc
    aborts on a corrupt heap (``"heap"``, glibc's words); every rank returns its rank."""
    if rank == 0 and not os.path.exists(marker):
        open(marker, "w").close()
        if how == "heap":
            os.write(2, b"malloc(): unaligned tcache chunk detected\n")
            os.abort()
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def forward_on_rank_zero_only(rank: int, world: int, evaluated_before: bool, warm_start: bool = False) -> None:
    """Two training steps; optionally one evaluation on every rank; then an evaluation on rank 0 only
    while the other ranks keep training. ``warm_start``: under Inductor, every graph loaded from the
    caches that :func:`evaluate_everywhere` filled (the message says how many were)."""
    groups = FsdpGroups.create()
    _, compiled = _tiny_model(groups, inductor=warm_start)
    for step in range(2):
        _train_step(compiled, step)
    if evaluated_before:
        with torch.no_grad():
            compiled(_tokens(9, 2, 6, TINY.vocab_size)[0])
        _train_step(compiled, 2)
    start = time.monotonic()
    try:
        if rank == 0:
            with torch.no_grad():
                compiled(_tokens(10, 2, 6, TINY.vocab_size)[0])
        for step in range(3, 5):
            _train_step(compiled, step)
    except Exception as e:
        if warm_start:
            e.add_note(f"graphs loaded from the caches: {counters['aot_autograd']['autograd_cache_hit']}")
        raise timed(start, e) from e


def peer_fails_before_a_loaded_backward(rank: int, world: int) -> None:
    """Under Inductor with every graph loaded from the caches :func:`evaluate_everywhere` filled: two
    training steps, then a forward on every rank, after which rank 1 fails; rank 0's backward, a loaded
    graph that no wrapper of ours compiled, then fails in a collective and must say what rank 1 did."""
    groups = FsdpGroups.create()
    _, compiled = _tiny_model(groups, inductor=True)
    for step in range(2):
        _train_step(compiled, step)
    x, y = _tokens(3, 2, 6, TINY.vocab_size)
    loss = loss_fn(compiled(x), y)
    if rank == 1:
        raise ValueError("this rank's next batch was corrupt")
    try:
        loss.backward()
    except Exception as e:
        e.add_note(f"graphs loaded from the caches: {counters['aot_autograd']['autograd_cache_hit']}")
        raise


def evaluate_everywhere(rank: int, world: int) -> dict[str, int]:
    """What :func:`forward_on_rank_zero_only` runs with ``warm_start``, on every rank alike (filling the
    caches with its training and inference graphs); AOTAutograd's cache counters."""
    groups = FsdpGroups.create()
    _, compiled = _tiny_model(groups, inductor=True)
    for step in range(3):
        _train_step(compiled, step)
        with torch.no_grad():
            compiled(_tokens(9, 2, 6, TINY.vocab_size)[0])
    return {k: int(v) for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache_")}


# ---------------------------------------------------------------------------------------------
# Freezing and initialising through module.<name> after sharding
# ---------------------------------------------------------------------------------------------


def _adjust(model: nn.Module) -> None:
    """What fine-tuning code does after building (here: after sharding) the model."""
    model.layers[0].attn.wq.weight.requires_grad_(False)  # type: ignore[index,union-attr]
    model.layers[1].ffn.w1.weight.requires_grad = False  # type: ignore[index,union-attr]
    nn.init.constant_(model.layers[1].attn.wo.weight, 0.01)  # type: ignore[index,union-attr]
    with torch.no_grad():
        model.output.weight[:3] = 0.5  # type: ignore[index]
        model.norm.weight.data.mul_(2.0)  # type: ignore[union-attr]


def freeze_and_init_after_sharding(rank: int, world: int) -> dict[str, Any]:
    groups = FsdpGroups.create()
    torch.manual_seed(0)
    model = shard_model(Transformer(TINY), groups)
    _adjust(model)
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    compiled = torch.compile(model, backend=make_backend(inductor=False))
    opt = make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    torch.manual_seed(0)
    ref = Transformer(TINY)
    _adjust(ref)
    ref_opt = make_optimizer("adamw", [p for p in ref.parameters() if p.requires_grad])
    losses, ref_losses = [], []
    for step in range(3):
        batches = [_tokens(step * 7 + r, 2, 6, TINY.vocab_size) for r in range(world)]
        loss, ref_loss = _step(compiled, opt, ref, ref_opt, batches, rank, world)
        losses.append(loss)
        ref_losses.append(ref_loss)
    wq = model.layers[0].attn.wq  # type: ignore[index,union-attr]
    full = wq.weight.detach().clone()  # a gather: every rank reads it
    shard = local_shard(wq, "weight")
    rows = shard.shape[0]
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "frozen": frozen,
        "wq_unchanged": torch.equal(full, ref.layers[0].attn.wq.weight.detach()),  # type: ignore[index,union-attr]
        "shard_is_rows": torch.equal(shard.detach()[: max(0, min(rows, full.shape[0] - rank * rows))],
                                     full[rank * rows:(rank + 1) * rows]),
    }


# ---------------------------------------------------------------------------------------------
# Soak: resident memory over many steps
# ---------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def soak(rank: int, world: int, steps: int, sample_every: int) -> list[tuple[int, int]]:
    """The default schedule (Inductor), AdamW and the clip call for ``steps`` steps; RSS samples."""
    groups = FsdpGroups.create()
    torch.manual_seed(0)
    model = shard_model(Transformer(TINY), groups)
    compiled = torch.compile(model, backend=make_backend())
    opt = make_optimizer("adamw", model.parameters())
    samples = []
    for step in range(steps):
        x, y = _tokens(step, 2, 8, TINY.vocab_size)
        loss_fn(compiled(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % sample_every == sample_every - 1:
            samples.append((step + 1, _rss_bytes()))
    groups.destroy()
    return samples


def trains_correctly(rank: int, world: int) -> dict[str, Any]:
    """The cases that must train exactly, in one spawn (start-up is much of each case's time)."""
    out = {}
    for name, run in (("clip", lambda: clip_training(rank, world, 3, 0.05)),
                      ("ragged", lambda: ragged_lengths(rank, world, {"inductor": False})),
                      ("freeze", lambda: freeze_and_init_after_sharding(rank, world)),
                      ("soak", lambda: soak(rank, world, 300, 10))):
        torch._dynamo.reset()
        out[name] = run()
    return out
