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

from splitspec.models.config import ConfigError, ModelConfig
from splitspec.models.dense import CausalLM
from splitspec.models.loader import PACKED_PARTS


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
    kda_heads: int = 0      # KDA heads (and their conv / recurrent state) per rank

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab

    def describe(self, cfg: ModelConfig) -> str:
        if cfg.hybrid is not None:
            h = cfg.hybrid
            kda = f"KDA heads and state {self.kda_heads}/rank, " if h.kda_layers else ""
            return (f"tp={self.world}: {kda}MLA heads {self.heads}/rank (latent cache whole on every rank), mlp "
                    f"intermediate {self.intermediate}/rank, expert intermediate "
                    f"{h.moe_intermediate_size // self.world}/rank (router replicated), vocab {self.vocab}/rank")
        kv = (f"kv heads replicated ({cfg.num_key_value_heads} for {self.world} ranks, 1/rank)" if self.kv_replicated
              else f"kv heads {self.kv_heads}/rank")
        return (f"tp={self.world}: attention heads {self.heads}/rank, {kv}, mlp intermediate "
                f"{self.intermediate}/rank, vocab {self.vocab}/rank (embedding and lm_head)")


def make_layout(cfg: ModelConfig, world: int, rank: int = 0) -> Layout:
    """The layout, or a ConfigError naming the dimension that does not divide."""
    if world < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {world}")
    if cfg.hybrid is not None:
        return _hybrid_layout(cfg, world, rank)
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


def _hybrid_layout(cfg: ModelConfig, world: int, rank: int) -> Layout:
    """MLA heads split (the latent cache stays whole on every rank), MLP and expert intermediates split."""
    h = cfg.hybrid
    sizes = {"num_attention_heads": h.num_heads, "intermediate_size": h.intermediate_size,
             "moe_intermediate_size": h.moe_intermediate_size,
             "moe_intermediate_size x n_shared_experts": h.moe_intermediate_size * h.n_shared_experts,
             "linear_attn_config.num_heads (KDA)": h.linear_num_heads if h.kda_layers else 0}
    for name, n in sizes.items():
        if n % world:
            raise ConfigError(f"--tensor-parallel-size {world} does not divide {name}={n}")
    return Layout(world=world, rank=rank, heads=h.num_heads // world, kv_heads=1, kv_replicated=True,
                  kv_head_start=0, intermediate=h.intermediate_size // world, vocab=-(-cfg.vocab_size // world),
                  kda_heads=h.linear_num_heads // world)


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


class _Slices(dict):
    """Parameter name -> (dim, start, length) of this rank's slice of the checkpoint tensor."""

    def column(self, prefix: str, module: nn.Linear, full_out: int, layout: Layout) -> None:
        n = module.out_features
        assert n * layout.world == full_out
        self[f"{prefix}.weight"] = (0, layout.rank * n, n)
        if module.bias is not None:
            self[f"{prefix}.bias"] = (0, layout.rank * n, n)

    def row(self, prefix: str, module: nn.Linear, layout: Layout) -> None:
        n = module.in_features
        self[f"{prefix}.weight"] = (1, layout.rank * n, n)


def _parallel_moe_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The router is replicated (every rank picks the same experts for a token: its input is the
    full residual stream); each expert and the shared experts hold a slice of their intermediate,
    so each rank's sum is partial and ONE all-reduce completes the block. K3's latent MoE needs
    the routed sum whole before its RMSNorm, so it reduces that sum first (two all-reduces)."""
    weights, ids = self.gate(x)
    if self.latent:
        y = all_reduce(self.routed(self.routed_expert_down_proj(x), weights, ids))
        if hasattr(self, "routed_expert_norm"):
            y = self.routed_expert_norm(y)
        y = self.routed_expert_up_proj(y)
        return y + all_reduce(self.shared_experts(x)) if hasattr(self, "shared_experts") else y
    y = self.routed(x, weights, ids)
    if hasattr(self, "shared_experts"):
        y = y + self.shared_experts(x)
    return all_reduce(y)


def _shard_kda(p: str, a, layout: Layout, sl: _Slices) -> None:
    """KDA by heads: q/k/v, their short convs, the decay's f_b and dt_bias, A_log, beta and the
    output gate hold this rank's heads; f_a / g_a (low rank) and the per-head-dim o_norm are
    replicated; o_proj is row-parallel. Each rank's recurrent and conv state is its heads' only."""
    H, D, K = a.heads, a.head_dim, a.kernel
    Hl = layout.kda_heads
    C, Cl = H * D, Hl * D
    hidden = a.q_proj.in_features
    a.heads = Hl
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(a, name, nn.Linear(hidden, Cl, bias=False))
        sl.column(f"{p}.{name}", getattr(a, name), C, layout)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        setattr(a, name, nn.Conv1d(Cl, Cl, K, groups=Cl, bias=False))
        sl[f"{p}.{name}.weight"] = (0, layout.rank * Cl, Cl)
    a.f_b_proj = nn.Linear(D, Cl, bias=False)
    sl.column(f"{p}.f_b_proj", a.f_b_proj, C, layout)
    a.dt_bias = nn.Parameter(torch.zeros(Cl))
    sl[f"{p}.dt_bias"] = (0, layout.rank * Cl, Cl)
    a.A_log = nn.Parameter(torch.zeros(Hl))
    sl[f"{p}.A_log"] = (0, layout.rank * Hl, Hl)
    a.b_proj = nn.Linear(hidden, Hl, bias=False)
    sl.column(f"{p}.b_proj", a.b_proj, H, layout)
    if hasattr(a, "g_proj"):
        a.g_proj = nn.Linear(hidden, Cl, bias=False)
        sl.column(f"{p}.g_proj", a.g_proj, C, layout)
    else:
        a.g_b_proj = nn.Linear(D, Cl, bias=False)
        sl.column(f"{p}.g_b_proj", a.g_b_proj, C, layout)
    a.o_proj = RowParallelLinear(Cl, a.o_proj.out_features, bias=False)
    sl.row(f"{p}.o_proj", a.o_proj, layout)


def shard_hybrid(model, layout: Layout) -> tuple[nn.Module, _Slices]:
    """An MLA + MoE (DeepSeek-V3 / Kimi-K2 shaped) HybridLM cut for `layout`, and the slice of
    every sharded parameter."""
    from splitspec.models.kda import KimiDeltaAttention
    from splitspec.models.mla import MLAttention
    from splitspec.models.moe import GLU, MoE
    cfg, h = model.cfg, model.cfg.hybrid
    H = cfg.hidden_size
    sl = _Slices()
    model.model.embed_tokens = VocabParallelEmbedding(layout.vocab, H, layout.vocab_start)
    model.lm_head = ParallelLMHead(H, layout.vocab, cfg.vocab_size, layout.rank, layout.world)
    for prefix in ("model.embed_tokens.weight", "lm_head.weight"):
        sl[prefix] = (0, layout.vocab_start, layout.vocab)

    def glu(prefix: str, mod: GLU, reduce: bool) -> None:
        g, u, d = mod.names
        inter = getattr(mod, g).out_features
        local = inter // layout.world
        for name in (g, u):
            setattr(mod, name, nn.Linear(getattr(mod, name).in_features, local, bias=False))
            sl.column(f"{prefix}.{name}", getattr(mod, name), inter, layout)
        out = getattr(mod, d).out_features
        setattr(mod, d, (RowParallelLinear if reduce else nn.Linear)(local, out, bias=False))
        sl.row(f"{prefix}.{d}", getattr(mod, d), layout)

    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        a = layer.self_attn
        if isinstance(a, MLAttention):
            a.heads = layout.heads
            qk, v, r = h.qk_head_dim, h.v_head_dim, h.kv_lora_rank
            if h.q_lora_rank is None:
                a.q_proj = nn.Linear(H, layout.heads * qk, bias=False)
                sl.column(f"{p}.self_attn.q_proj", a.q_proj, h.num_heads * qk, layout)
            else:
                a.q_b_proj = nn.Linear(h.q_lora_rank, layout.heads * qk, bias=False)
                sl.column(f"{p}.self_attn.q_b_proj", a.q_b_proj, h.num_heads * qk, layout)
            a.kv_b_proj = nn.Linear(r, layout.heads * (h.qk_nope_head_dim + v), bias=False)
            sl.column(f"{p}.self_attn.kv_b_proj", a.kv_b_proj, h.num_heads * (h.qk_nope_head_dim + v), layout)
            if h.mla_output_gate:
                a.g_proj = nn.Linear(H, layout.heads * v, bias=False)
                sl.column(f"{p}.self_attn.g_proj", a.g_proj, h.num_heads * v, layout)
            a.o_proj = RowParallelLinear(layout.heads * v, H, bias=h.attention_bias)
            sl.row(f"{p}.self_attn.o_proj", a.o_proj, layout)
        elif isinstance(a, KimiDeltaAttention):
            _shard_kda(f"{p}.self_attn", a, layout, sl)
        mlp = getattr(layer, layer.mlp_name)
        if isinstance(mlp, MoE):
            for e, expert in enumerate(mlp.experts):
                glu(f"{p}.{layer.mlp_name}.experts.{e}", expert, reduce=False)
            if hasattr(mlp, "shared_experts"):
                glu(f"{p}.{layer.mlp_name}.shared_experts", mlp.shared_experts, reduce=False)
            mlp.__class__ = type("ParallelMoE", (MoE,), {"forward": _parallel_moe_forward})
        else:
            glu(f"{p}.{layer.mlp_name}", mlp, reduce=True)
    return model, sl


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


def packed_slice(name: str, t: torch.Tensor, slices: dict) -> tuple[int, int, int] | None:
    """This rank's (dim, start, length) of a packed FP4 part `t` (the full checkpoint tensor),
    from its weight's slice: rows as they are; columns (the input dimension) at two codes a byte
    and one scale per group (32 MXFP4, 16 NVFP4), so a column cut must fall on a group boundary.
    None: not cut (the NVFP4 global scale, a replicated weight)."""
    base, _, part = name.rpartition(".")
    cut = slices.get(base + ".weight")
    if cut is None or part == "weight_global_scale":
        return None
    dim, start, length = cut
    if dim == 0:
        return cut
    if part == "weight_packed":
        return dim, start // 2, length // 2
    group = 16 if t.dtype == torch.float8_e4m3fn else 32
    if start % group or length % group:
        raise ValueError(f"{name}: this rank's input columns {start}..{start + length} do not fall on "
                         f"{group}-element scale groups; use a tensor-parallel size that divides the "
                         f"expert intermediate into multiples of {group}")
    return dim, start // group, length // group


def _cut(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    part = t.narrow(dim, start, min(length, t.shape[dim] - start))
    if part.shape[dim] < length:        # a vocabulary range past the end: zero rows
        pad = list(part.shape)
        pad[dim] = length - part.shape[dim]
        part = torch.cat([part, part.new_zeros(pad)], dim=dim)
    return part


def _load_hybrid(path: Path, cfg: ModelConfig, layout: Layout, dtype: torch.dtype, device: torch.device):
    from splitspec.models.hybrid import HybridLM
    from splitspec.models.hybrid_weights import adapt_tensor, checkpoint_name, ignored
    from splitspec.models.loader import load_state, pack_fp4, quantization_scheme, stored_head_wins, weight_files
    quant = quantization_scheme(path)
    files = weight_files(path)
    cfg = stored_head_wins(cfg, files)
    with torch.device("meta"):
        model, slices = shard_hybrid(HybridLM(cfg), layout)
    pack_fp4(model, files, quant, source=checkpoint_name)       # this rank's slice of each expert, packed
    model = model.to_empty(device=device).to(dtype)
    if layout.kda_heads:        # pools.make_pool sizes this rank's KDA state by it
        model.local_kda_heads = layout.kda_heads
    for p in model.fp32_parameters():
        p.data = p.data.float()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight

    def adapt(name, t, p):
        # `t` is the full checkpoint tensor; a packed expert's bytes and scales are cut along its
        # intermediate like the weight they encode (packed_slice).
        if name.endswith(PACKED_PARTS):
            cut = packed_slice(name, t, slices)
            return t if cut is None else _cut(t, *cut)
        if name.endswith("A_log") and name in slices:
            # Checkpoints store A_log [1, 1, H, 1] or padded to the head dim: the first H values
            # are the heads', cut before this rank's slice is taken.
            t = t.reshape(-1)[:cfg.hybrid.linear_num_heads]
        else:
            t = adapt_tensor(name, t, p)
        return _cut(t, *slices[name]) if name in slices else t
    skip = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    load_state(model, files, skip=skip, source=checkpoint_name, adapt=adapt,
               ignored=lambda n: ignored(cfg, n))
    return model.eval().requires_grad_(False), layout


def load_sharded(path: str | Path, layout_world: int, rank: int, *, dtype: torch.dtype,
                 device: torch.device) -> tuple[CausalLM, Layout]:
    """Build and load rank `rank`'s shard of the checkpoint at `path`."""
    from splitspec.models.loader import load_state, quantization_scheme, read_eos_ids, weight_files
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    eos = read_eos_ids(path) or cfg.eos_token_ids
    if eos != cfg.eos_token_ids:
        cfg = ModelConfig(**{**cfg.__dict__, "eos_token_ids": eos})
    layout = make_layout(cfg, layout_world, rank)
    if cfg.hybrid is not None:
        return _load_hybrid(path, cfg, layout, dtype, device)
    if quantization_scheme(path) is not None:
        raise ValueError(f"{path}: an FP4-packed dense checkpoint loads at tensor-parallel size 1 only "
                         f"(packed experts of the Kimi / DeepSeek-V3 family shard)")
    with torch.device("meta"):
        model = shard_model(CausalLM(cfg), layout)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:     # both vocab-parallel over the same ranges, so the tie holds per rank
        model.lm_head.weight = model.model.embed_tokens.weight
    skip = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    load_state(model, weight_files(path), skip=skip, adapt=lambda name, t, p: shard_tensor(name, t, cfg, layout))
    return model.eval().requires_grad_(False), layout
