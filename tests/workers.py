"""Rank functions for the multi-process tests (module level, so spawned processes can import them).

A ``Case`` says what to train and how; ``train_case`` runs it sharded on every rank and, on the same
process, the single-process eager reference on the global batch, and returns both for the test to
compare.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import _world

from fsdp_compile import FsdpGroups, MixedPrecisionPolicy, fully_shard, make_backend
from fsdp_compile.api.sharding import _cast_hooks
from fsdp_compile.examples.models import FeedForward, ModelConfig, Transformer, loss_fn
from fsdp_compile.api.stack import BlockStack
from fsdp_compile.api.sharding import unit_of

TINY = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_seq_len=16)


class UnevenBlock(nn.Module):
    """Width-10 block: a shared module (``proj`` twice), a param shared by two modules, a buffer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.again = self.proj  # the same module under a second name
        self.gate = nn.Linear(width, width, bias=False)
        self.up = nn.Linear(width, width, bias=False)
        self.up.weight = self.gate.weight  # one param, two modules, one unit
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.again(torch.tanh(self.proj(x)))) * self.scale
        return x + self.up(torch.sigmoid(self.gate(h)))


class UnevenModel(nn.Module):
    """Vocabulary 1001 and width 10: nothing divides evenly by 4 ranks."""

    def __init__(self, vocab: int = 1001, width: int = 10, n_layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(UnevenBlock(width) for _ in range(n_layers))
        self.head = nn.Linear(width, vocab)
        self.emb.weight.requires_grad_(False)  # frozen: gathered, never reduced

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class CheckpointedLlama(Transformer):
    """Activation checkpointing inside every block (torch.utils.checkpoint, non-reentrant)."""

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, self.rope_cos, self.rope_sin, use_reentrant=False)
        return self.output(self.norm(x))


class BrokenLlama(Transformer):
    """A graph break after every block: several compiled graphs per step."""

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
            torch._dynamo.graph_break()
        return self.output(self.norm(x))


class HuggingFace(nn.Module):
    """A Hugging Face ``transformers`` causal LM from a small config (no download), unchanged inside:
    ``layers`` names its decoder blocks so the usual blocks-then-root sharding applies."""

    def __init__(self, kind: str, cfg: ModelConfig) -> None:
        super().__init__()
        import transformers  # optional: only these tests need it

        if kind == "llama":
            config = transformers.LlamaConfig(
                vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
                max_position_embeddings=cfg.max_seq_len, attn_implementation="sdpa",
            )
            self.hf = transformers.LlamaForCausalLM(config)
            self.layers = self.hf.model.layers
        elif kind == "mistral":  # a sliding window shorter than the sequence (masks built per call)
            config = transformers.MistralConfig(
                vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads // 2,
                max_position_embeddings=cfg.max_seq_len, sliding_window=4, attn_implementation="sdpa",
            )
            self.hf = transformers.MistralForCausalLM(config)
            self.layers = self.hf.model.layers
        else:
            config = transformers.GPT2Config(
                vocab_size=cfg.vocab_size, n_embd=cfg.dim, n_layer=cfg.n_layers, n_head=cfg.n_heads,
                n_positions=cfg.max_seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
            )
            self.hf = transformers.GPT2LMHeadModel(config)  # ties lm_head.weight to wte.weight
            self.layers = self.hf.transformer.h

    def forward(self, tokens: Tensor) -> Tensor:
        return self.hf(input_ids=tokens).logits


class GatedFeedForward(FeedForward):
    """``FeedForward``'s parameters (names and shapes), another computation: the dense and expert layers
    of one decoder-layer class (DeepSeek, Qwen-MoE, Llama 4, Jamba)."""

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(torch.sigmoid(self.w1(x)) * self.w3(x))


def alternating_llama(cfg: ModelConfig) -> Transformer:
    """The Llama with every second block's feed-forward a ``GatedFeedForward``: blocks of one class that
    are not alike (two outlined bodies, NOTE [outlining by proof])."""
    model = Transformer(cfg)
    for block in model.layers[1::2]:
        block.ffn = GatedFeedForward(cfg)  # type: ignore[union-attr]
    return model


def stacked_llama(cfg: ModelConfig) -> Transformer:
    """The Llama with its blocks in a :class:`BlockStack` (traced once when compiled)."""
    model = Transformer(cfg)
    model.layers = BlockStack(model.layers)  # type: ignore[assignment]
    return model


MODELS = {
    "llama": Transformer,
    "llama-stacked": stacked_llama,
    "llama-ac": CheckpointedLlama,
    "llama-break": BrokenLlama,
    "hf-llama": lambda cfg: HuggingFace("llama", cfg),
    "hf-gpt2": lambda cfg: HuggingFace("gpt2", cfg),
    "hf-mistral": lambda cfg: HuggingFace("mistral", cfg),
    "llama-alternating": alternating_llama,
}


@dataclass(frozen=True)
class Case:
    """One training comparison."""

    model: str = "llama"  # a key of MODELS (built from cfg), or "uneven" (UnevenModel)
    cfg: ModelConfig = TINY
    optim: str = "adamw"
    steps: int = 10
    microbatches: int = 1  # forward/backward calls per optimizer step
    per_rank_batch: int = 2
    seq: int = 8
    run: str = "fsdp"  # "fsdp" (fsdp_backend), "eager" (uncompiled), "inductor" (another backend)
    backend_kw: dict[str, Any] = field(default_factory=dict)
    group_kw: dict[str, Any] = field(default_factory=dict)
    shard_kw: dict[str, Any] = field(default_factory=dict)  # fully_shard options for the blocks
    root_kw: dict[str, Any] | None = None  # ... and for the root (default: the same)
    device: str = "cpu"  # where the sharded run trains; the reference always runs on the CPU
    no_sync: bool = False  # all microbatches but the last run with set_requires_gradient_sync(False)
    count_collectives: bool = False  # profile each step to count its reduce-scatters (slower)
    mesh: tuple[int, int] | None = None  # HSDP: a (replicate, shard) DeviceMesh instead of WORLD

    def build(self) -> nn.Module:
        torch.manual_seed(0)
        if self.model == "uneven":
            return UnevenModel()
        return MODELS[self.model](self.cfg)

    @property
    def vocab(self) -> int:
        return 1001 if self.model == "uneven" else self.cfg.vocab_size


def make_batches(case: Case, world: int) -> list[list[tuple[Tensor, Tensor]]]:
    """``steps`` lists of ``microbatches`` global (tokens, targets) batches."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(case.steps):
        micro = []
        for _ in range(case.microbatches):
            tokens = torch.randint(0, case.vocab, (case.per_rank_batch * world, case.seq + 1), generator=g)
            micro.append((tokens[:, :-1], tokens[:, 1:]))
        out.append(micro)
    return out


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(name)


def shard_model(model: nn.Module, groups: FsdpGroups, root_kw: dict[str, Any] | None = None, **kw: Any) -> nn.Module:
    """Blocks first (each a unit, also in a BlockStack), then the root."""
    for block in model.layers:  # type: ignore[union-attr]
        fully_shard(block, groups=groups, **kw)
    fully_shard(model, groups=groups, **(kw if root_kw is None else root_kw))
    return model


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class CastTo(nn.Module):
    """A parametrization that reads a param in another dtype (the reference's mixed precision)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: Tensor) -> Tensor:
        return x.to(self.dtype)


def apply_reference_casts(model: nn.Module, block_mp: MixedPrecisionPolicy, root_mp: MixedPrecisionPolicy) -> None:
    """The casts sharded units apply, on an unsharded model: params read in their unit's
    ``param_dtype``, and each block's and the root's inputs and outputs cast as ``fully_shard`` does."""
    in_blocks = {id(m) for block in model.layers for m in block.modules()}  # type: ignore[attr-defined]
    for module in list(model.modules()):
        dtype = (block_mp if id(module) in in_blocks else root_mp).param_dtype
        for name, _ in list(module.named_parameters(recurse=False)) if dtype is not None else ():
            torch.nn.utils.parametrize.register_parametrization(module, name, CastTo(dtype), unsafe=True)
    for block in model.layers:  # type: ignore[attr-defined]
        _cast_hooks(block, block_mp)
    _cast_hooks(model, root_mp)


def reference_run(case: Case, batches: list) -> tuple[list[float], dict[str, Tensor]]:
    """Single-process eager training on the global batches: losses per step, first step's grads."""
    model = case.build()
    block_mp = case.shard_kw.get("mp_policy")
    root_mp = (case.root_kw if case.root_kw is not None else case.shard_kw).get("mp_policy")
    if block_mp is not None or root_mp is not None:
        apply_reference_casts(model, block_mp or MixedPrecisionPolicy(), root_mp or MixedPrecisionPolicy())
    opt = make_optimizer(case.optim, _trainable(model))
    losses, grads0 = [], {}
    for step, micro in enumerate(batches):
        total = 0.0
        for x, y in micro:
            loss = loss_fn(model(x), y) / case.microbatches
            loss.backward()
            total += loss.item()
        if step == 0:
            grads0 = {_plain_name(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, grads0


def _plain_name(name: str) -> str:
    """``a.parametrizations.weight.original`` -> ``a.weight`` (the reference's cast parametrization)."""
    return name.replace(".parametrizations.", ".").replace(".original", "")


def sharded_grads(model: nn.Module) -> dict[str, Tensor]:
    """Each managed param's shard grad by its name relative to the root."""
    out = {}
    for m in model.modules():
        unit = unit_of(m)
        for sp in unit.params if unit is not None else ():
            if sp.shard.grad is not None:
                out[sp.fqn] = sp.shard.grad.detach().cpu().clone()
    return out


def ref_slice(full: Tensor, rank: int, world: int) -> Tensor:
    """The rows of ``full`` that ``rank`` holds, padded with zeros as the shard is."""
    full = full.reshape(1) if full.dim() == 0 else full
    rows = -(-full.shape[0] // world)
    padded = full.new_zeros(rows * world, *full.shape[1:])
    padded[: full.shape[0]] = full
    return padded[rank * rows:(rank + 1) * rows]


def train_case(rank: int, world: int, case: Case) -> dict[str, Any]:
    """Train ``case`` sharded on this rank's slice of every global batch; also run the reference."""
    batches = make_batches(case, world)
    if case.mesh is not None:
        mesh = init_device_mesh(case.device, case.mesh, mesh_dim_names=("replicate", "shard"))
        groups = FsdpGroups.create(mesh, **case.group_kw)
    else:
        groups = FsdpGroups.create(**case.group_kw)
    device = torch.device(case.device, torch.cuda.current_device()) if case.device == "cuda" else torch.device("cpu")
    model = shard_model(case.build().to(device), groups, case.root_kw, **case.shard_kw)
    if case.run == "fsdp":
        step_model = torch.compile(model, backend=make_backend(**case.backend_kw))
    elif case.run == "inductor":
        step_model = torch.compile(model, backend="inductor")
    else:
        step_model = model
    opt = make_optimizer(case.optim, _trainable(model))
    losses, grads0, scatters = [], {}, []
    lo, hi = rank * case.per_rank_batch, (rank + 1) * case.per_rank_batch
    n_groups = len(_world.pg_map)
    shard_rank, shard_world = groups.all_gather.rank(), groups.shard_size
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, micro in enumerate(batches):
            total = torch.zeros((), device=device)
            with CountCollectives(case.count_collectives) as counted:
                for i, (x, y) in enumerate(micro):
                    if case.no_sync:
                        model.set_requires_gradient_sync(i == len(micro) - 1)
                    x, y = x.to(device), y.to(device)
                    loss = loss_fn(step_model(x[lo:hi]), y[lo:hi]) / case.microbatches
                    loss.backward()
                    total += loss.detach()
            scatters.append(counted.reduce_scatters)
            if step == 0:
                grads0 = sharded_grads(model)
            opt.step()
            opt.zero_grad()
            dist.all_reduce(total)
            losses.append(total.item() / world)
    ref_losses, ref_grads = reference_run(case, batches)
    groups.destroy()
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "grads0": grads0,
        "ref_grads0": {n: ref_slice(ref_grads[n], shard_rank, shard_world) for n in grads0},
        "ref_grad_names": sorted(ref_grads),
        "warnings": [str(w.message) for w in caught],
        "reduce_scatters": scatters,
        "groups": n_groups,
        "shard_world": shard_world,
        "aot_cache": {k.removeprefix("autograd_cache_"): int(v) for k, v in counters["aot_autograd"].items()
                      if k.startswith("autograd_cache_")},
    }


class CountCollectives:
    """Counts the reduce-scatters run while active, from compiled code and eager code alike.

    The profiler records every op that goes through the dispatcher, as Inductor's generated code does;
    a dispatch mode would not do (Dynamo does not compile under one).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.reduce_scatters = -1

    def __enter__(self) -> CountCollectives:
        if self.enabled:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._prof.__exit__(*exc)
            names = [e.name for e in self._prof.events()]
            self.reduce_scatters = sum(1 for n in names if n == "_c10d_functional::reduce_scatter_tensor")


def train_cases(rank: int, world: int, cases: list[Case]) -> list[dict[str, Any]]:
    """``train_case`` for each of ``cases`` in turn, in one process per rank: one start-up (spawn,
    imports) for several comparisons. Dynamo's caches are cleared between cases."""
    results = []
    for case in cases:
        torch._dynamo.reset()
        results.append(train_case(rank, world, case))
    return results


def _all_done(done: bool, group: dist.ProcessGroup) -> bool:
    """Whether any rank of ``group`` is done (the same answer on every rank)."""
    flag = torch.tensor([float(done)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def collectives_in_flight(rank: int, world: int, seconds: float) -> dict[str, Any]:
    """``FsdpGroups`` made over a plain (two-thread) gloo group, then, for ``seconds``: four functional
    all-gathers in flight on its all-gather group, waited, then four reduce-scatters on its
    reduce-scatter group, waited (NOTE [one gloo thread per group]); returns what the groups are and the rounds run.
    The ranks agree when to stop (each round ends with a max over their "time is up"), so none starts a
    round the other does not run."""
    from datetime import timedelta

    from fsdp_compile._compat import group_timeout_s

    plain = dist.new_group(backend="gloo", timeout=timedelta(seconds=90))
    groups = FsdpGroups.create(plain)
    c10d = torch.ops._c10d_functional
    xs = [torch.full((1000 + 7 * i,), float(rank)) for i in range(4)]
    deadline, rounds = time.monotonic() + seconds, 0
    while not _all_done(time.monotonic() >= deadline, plain):
        for group in (groups.all_gather, groups.reduce_scatter):
            if group is groups.all_gather:
                out = [c10d.all_gather_into_tensor(x, world, group.group_name) for x in xs]
            else:
                out = [c10d.reduce_scatter_tensor(x[:998], "sum", world, group.group_name) for x in xs]
            for t in out:
                c10d.wait_tensor(t)
        rounds += 1
    pgs = {"all_gather": groups.all_gather, "reduce_scatter": groups.reduce_scatter}
    info = {name: (dist.get_backend(pg), pg._get_backend(torch.device("cpu")).options._threads, group_timeout_s(pg),
                   pg is plain) for name, pg in pgs.items()}
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(xs[0], world, groups.all_gather.group_name))
    groups.destroy()
    return {"groups": info, "rounds": rounds, "last": gathered[:2].tolist() + gathered[-2:].tolist()}
