"""Tensor-parallel layers and sharded loading for the dense families (Llama / Qwen2 / Qwen3).

Every rank holds a slice of every large weight (the Megatron / vLLM / nano-vllm layout):

* q / k / v and gate / up are column-parallel: a rank holds whole heads (whole rows of the
  intermediate), so attention and the SwiGLU product need no communication;
* o_proj and down_proj are row-parallel: each rank's partial product is summed by one
  all-reduce, after which every rank holds the full residual stream (so the draft's taps are
  read on rank 0 with no gather);
* the embedding is vocab-parallel (a rank looks up the ids in its range, zeros elsewhere, one
  all-reduce) and so is lm_head (each rank scores its vocabulary range; rank 0 gathers them,
  since only rank 0 samples and verifies);
* with fewer KV heads than ranks, each rank keeps the one KV head its query heads read
  (replicated across the ranks that share it); the KV pool then holds that head only.

The modules keep transformers' names, so the checkpoint loads through `loader.load_state`
with an `adapt` hook that cuts each full tensor down to this rank's slice (one tensor in
memory at a time, read from the memory-mapped safetensors file)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, ModelConfig
from .model import CausalLM


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group failed or stopped answering: the replica is out of
    service (UNAVAILABLE, so the gateway moves the request to another replica)."""


@dataclass(frozen=True)
class Layout:
    """How one model is cut across `world` ranks, and what rank `rank` holds."""
    world: int
    rank: int
    heads: int              # query heads per rank
    kv_heads: int           # KV heads per rank (1 when replicated)
    kv_replicated: bool     # fewer KV heads than ranks: ranks sharing a KV head each keep a copy
    kv_head_start: int      # first KV head this rank holds
    intermediate: int       # MLP intermediate rows per rank
    vocab: int              # vocabulary rows per rank (the last rank's range is padded with zeros)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab

    def describe(self, cfg: ModelConfig) -> str:
        kv = (f"kv heads replicated ({cfg.num_key_value_heads} for {self.world} ranks, 1/rank)" if self.kv_replicated
              else f"kv heads {self.kv_heads}/rank")
        return (f"tp={self.world}: attention heads {self.heads}/rank, {kv}, mlp intermediate "
                f"{self.intermediate}/rank, vocab {self.vocab}/rank (embedding and lm_head)")


def make_layout(cfg: ModelConfig, world: int, rank: int = 0) -> Layout:
    """The layout, or a ConfigError naming the dimension that does not divide."""
    if world < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {world}")
    if cfg.hybrid is not None:
        raise ConfigError(f"--tensor-parallel-size {world}: {cfg.architecture} (MLA / KDA / MoE layers) is not "
                          f"sharded yet; tensor parallelism covers Llama, Qwen2 and Qwen3. Use "
                          f"--tensor-parallel-size 1")
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if h % world:
        raise ConfigError(f"--tensor-parallel-size {world} does not divide num_attention_heads={h}")
    if cfg.intermediate_size % world:
        raise ConfigError(f"--tensor-parallel-size {world} does not divide intermediate_size={cfg.intermediate_size}")
    if kv >= world:
        if kv % world:
            raise ConfigError(f"--tensor-parallel-size {world} does not divide num_key_value_heads={kv}")
        kv_local, replicated, kv_start = kv // world, False, rank * (kv // world)
    else:
        if world % kv:
            raise ConfigError(f"num_key_value_heads={kv} is fewer than --tensor-parallel-size {world} and does not "
                              f"divide it, so the KV heads cannot be replicated evenly")
        heads_local = h // world
        kv_local, replicated, kv_start = 1, True, (rank * heads_local) // (h // kv)
    return Layout(world=world, rank=rank, heads=h // world, kv_heads=kv_local, kv_replicated=replicated,
                  kv_head_start=kv_start, intermediate=cfg.intermediate_size // world,
                  vocab=-(-cfg.vocab_size // world))


# ---- communication -----------------------------------------------------------------------------

class CommStats:
    """Time spent in this process's collectives; on only when a benchmark asks (the timer forces
    a device sync on CUDA, which a served forward must not pay)."""
    enabled = False
    calls = 0
    seconds = 0.0

    @classmethod
    def reset(cls, enabled: bool = True) -> None:
        cls.enabled, cls.calls, cls.seconds = enabled, 0, 0.0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if not CommStats.enabled:
        dist.all_reduce(x)
        return x
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    t = time.perf_counter()
    dist.all_reduce(x)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    CommStats.calls += 1
    CommStats.seconds += time.perf_counter() - t
    return x


# ---- layers ------------------------------------------------------------------------------------

class RowParallelLinear(nn.Linear):
    """Holds the input columns of this rank; the partial products are summed across ranks.
    The bias is added once, after the sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the table; an id outside them contributes zeros,
    so the all-reduce leaves every token's own row (a sum of one row and zeros: exact)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, start: int):
        super().__init__(num_embeddings, embedding_dim)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0)
        return all_reduce(out)


class ParallelLMHead(nn.Linear):
    """Scores this rank's vocabulary range; rank 0 gathers every range into the full logits
    (cut back to the real vocabulary), the other ranks return None: only rank 0 samples."""

    def __init__(self, hidden: int, vocab_local: int, vocab: int, rank: int, world: int):
        super().__init__(hidden, vocab_local, bias=False)
        self.vocab, self.rank, self.world = vocab, rank, world

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        local = F.linear(x, self.weight).contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(local) for _ in range(self.world)]
            dist.gather(local, parts, dst=0)
            return torch.cat(parts, dim=-1)[..., :self.vocab]
        dist.gather(local, None, dst=0)
        return None


def shard_model(model: CausalLM, layout: Layout) -> CausalLM:
    """Swap `model`'s large layers for this rank's shards (call on a meta-device model, then
    materialize and load). Names stay transformers', so loading needs no renaming."""
    cfg = model.cfg
    hd, H = cfg.head_dim, cfg.hidden_size
    model.model.embed_tokens = VocabParallelEmbedding(layout.vocab, H, layout.vocab_start)
    model.lm_head = ParallelLMHead(H, layout.vocab, cfg.vocab_size, layout.rank, layout.world)
    for layer in model.model.layers:
        a = layer.self_attn
        a.n_heads, a.n_kv = layout.heads, layout.kv_heads
        a.q_proj = nn.Linear(H, layout.heads * hd, bias=cfg.qkv_bias)
        a.k_proj = nn.Linear(H, layout.kv_heads * hd, bias=cfg.qkv_bias)
        a.v_proj = nn.Linear(H, layout.kv_heads * hd, bias=cfg.qkv_bias)
        a.o_proj = RowParallelLinear(layout.heads * hd, H, bias=cfg.o_bias)
        m = layer.mlp
        m.gate_proj = nn.Linear(H, layout.intermediate, bias=cfg.mlp_bias)
        m.up_proj = nn.Linear(H, layout.intermediate, bias=cfg.mlp_bias)
        m.down_proj = RowParallelLinear(layout.intermediate, H, bias=cfg.mlp_bias)
    return model


def shard_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, layout: Layout) -> torch.Tensor:
    """This rank's slice of the full checkpoint tensor for parameter `name`."""
    hd, r = cfg.head_dim, layout.rank
    leaf = name.rsplit(".", 2)
    kind, what = leaf[-2], leaf[-1]
    if kind in ("embed_tokens", "lm_head"):
        start = layout.vocab_start
        part = t[start:start + layout.vocab]
        if part.shape[0] < layout.vocab:     # the last range runs past the vocabulary: zero rows
            part = torch.cat([part, part.new_zeros(layout.vocab - part.shape[0], *part.shape[1:])])
        return part
    if kind == "q_proj":
        return t[r * layout.heads * hd:(r + 1) * layout.heads * hd]
    if kind in ("k_proj", "v_proj"):
        s = layout.kv_head_start * hd
        return t[s:s + layout.kv_heads * hd]
    if kind == "o_proj":
        return t[:, r * layout.heads * hd:(r + 1) * layout.heads * hd] if what == "weight" else t
    if kind in ("gate_proj", "up_proj"):
        return t[r * layout.intermediate:(r + 1) * layout.intermediate]
    if kind == "down_proj":
        return t[:, r * layout.intermediate:(r + 1) * layout.intermediate] if what == "weight" else t
    return t            # norms: replicated


def load_sharded(path: str | Path, layout_world: int, rank: int, *, dtype: torch.dtype,
                 device: torch.device) -> tuple[CausalLM, Layout]:
    """Build and load rank `rank`'s shard of the checkpoint at `path`."""
    from .loader import load_state, read_eos_ids, weight_files
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    eos = read_eos_ids(path) or cfg.eos_token_ids
    if eos != cfg.eos_token_ids:
        cfg = ModelConfig(**{**cfg.__dict__, "eos_token_ids": eos})
    layout = make_layout(cfg, layout_world, rank)
    with torch.device("meta"):
        model = shard_model(CausalLM(cfg), layout)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:     # both vocab-parallel over the same ranges, so the tie holds per rank
        model.lm_head.weight = model.model.embed_tokens.weight
    skip = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    load_state(model, weight_files(path), skip=skip,
               adapt=lambda name, t, p: shard_tensor(name, t, cfg, layout))
    return model.eval().requires_grad_(False), layout
