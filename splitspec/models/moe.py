"""GLU MLPs and the routed mixture of experts of the Kimi / DeepSeek-V3 families.

Router: sigmoid scores over `gate.weight` (fp32), plus `e_score_correction_bias` for the choice
only (DeepSeek's noaux_tc); experts in `n_group` groups, the best `topk_group` groups by the sum
of their two best scores; top-k experts among those; weights are the un-biased scores of the
chosen experts, renormalised when configured, times `routed_scaling_factor`. Shared experts
always run on the full width.

K3's latent MoE: the routed experts run in a narrower latent width (`routed_expert_down_proj`
in, RMS-normed sum `routed_expert_norm`, `routed_expert_up_proj` out) while routing reads the
full hidden state. SiTU-GLU (K3's `hidden_act: situ`): act(g, u) = b·tanh(g/b)·σ(g) · c·tanh(u/c)
with b = `activation_situ_beta`, c = `activation_situ_linear_beta`."""
from __future__ import annotations

import torch
from torch import nn

from splitspec.models.hybrid_config import HybridConfig
from splitspec.models.dense import RMSNorm


def situ_glu(g: torch.Tensor, u: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


def glu(act: str, g: torch.Tensor, u: torch.Tensor, situ: tuple[float, float]) -> torch.Tensor:
    return situ_glu(g, u, *situ) if act == "situ" else nn.functional.silu(g) * u


class GLU(nn.Module):
    """down(act(gate x, up x)); the projections are named as the checkpoint names them."""

    def __init__(self, hidden: int, inter: int, act: str, situ: tuple[float, float],
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names, self.act, self.situ = names, act, situ
        g, u, d = names
        setattr(self, g, nn.Linear(hidden, inter, bias=False))
        setattr(self, u, nn.Linear(hidden, inter, bias=False))
        setattr(self, d, nn.Linear(inter, hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u, d = (getattr(self, n) for n in self.names)
        return d(glu(self.act, g(x), u(x), self.situ))


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
          renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k], expert ids [N, k]) from router logits [N, E] (fp32)."""
    scores = logits.sigmoid()
    choice = scores + bias
    if n_group > 1 and topk_group < n_group:
        N, E = choice.shape
        grouped = choice.view(N, n_group, E // n_group)
        group_score = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(N, E), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, ids


class Router(nn.Module):
    def __init__(self, cfg: HybridConfig, hidden: int):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        logits = x.float() @ self.weight.float().t()
        return route(logits, self.e_score_correction_bias.float(), c.top_k, c.n_group, c.topk_group,
                     c.norm_topk_prob, c.routed_scaling_factor)


class MoE(nn.Module):
    def __init__(self, cfg: HybridConfig, hidden: int, eps: float, situ: tuple[float, float]):
        super().__init__()
        width = cfg.latent_dim or hidden
        self.gate = Router(cfg, hidden)
        self.experts = nn.ModuleList(GLU(width, cfg.moe_intermediate_size, cfg.hidden_act, situ, cfg.expert_names)
                                     for _ in range(cfg.num_experts))
        if cfg.n_shared_experts:
            self.shared_experts = GLU(hidden, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.hidden_act, situ)
        self.latent = cfg.latent_dim is not None
        if self.latent:
            self.routed_expert_down_proj = nn.Linear(hidden, width, bias=False)
            self.routed_expert_up_proj = nn.Linear(width, hidden, bias=False)
            if cfg.latent_norm:
                self.routed_expert_norm = RMSNorm(width, eps)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Σ_k weights[:, k] · expert_{ids[:, k]}(x), experts run once on the tokens routed to them."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            y = self.experts[e](x[tok]) * weights[tok, slot, None]
            out[tok] += y.to(out.dtype)      # a token picks an expert at most once: no repeated index
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.latent:
            y = self.routed(self.routed_expert_down_proj(x), weights, ids)
            if hasattr(self, "routed_expert_norm"):
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        else:
            y = self.routed(x, weights, ids)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x)
        return y
