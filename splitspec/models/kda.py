"""Kimi Delta Attention (KDA) over a ragged batch, in plain torch.

Per token: q, k, v = SiLU(short causal depthwise conv(W x)); q and k L2-normalised, q scaled by
Dk^-1/2; a per-channel log-decay g (softplus form, or K3's "safe gate" with a lower bound) and
β = σ(b_proj x). Per head the state S [Dk, Dv] follows the gated delta rule

    S <- Diag(e^g) S;   S <- S + β k (v - Sᵀk)ᵀ;   o = Sᵀ q

and the output is o_proj(RMSNorm_head(o) · σ(gate)), the gate low-rank (g_a/g_b) or full-rank
(K3's g_proj).

Sessions carry the conv window and S in `StatePool` slots. The recurrence runs token by token
(a verify is a handful of tokens; a prompt pays a Python loop per token, which is the price of
plain torch without a chunked kernel), all rows of a group in lock step. Rows whose kept tokens
are known only after sampling (verify) keep their per-token states (rollback "snapshot") or their
per-token inputs (rollback "replay"); `LayerPending.commit` turns that into the state of the
kept path. A tree row walks parent indices, so a node starts from its parent's state and its
conv window runs through its ancestors."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitspec.models.hybrid_config import HybridConfig
from splitspec.engine.state_pool import StatePlan, StatePool


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # eps inside the square root, as FLA's kernels (and so the released models) do
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_decay(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
              lower_bound: float | None) -> torch.Tensor:
    """Log-decay g <= 0, [N, H, Dk], from the gate projection f [N, H, Dk] (fp32).
    Kimi-Linear: g = -exp(A) · softplus(f + dt_bias). K3's safe gate: g = lb · σ(exp(A) · (f + dt_bias)),
    which keeps every channel's one-step decay above e^lb."""
    x = f + dt_bias.float().view(f.shape[1:])
    a = a_log.float().exp().view(-1, 1)
    if lower_bound is None:
        return -a * F.softplus(x)       # softplus is linear above 20, like the reference
    return lower_bound * torch.sigmoid(a * x)


def delta_step(S, q, k, v, g, beta):
    """One token of the gated delta rule for R rows at once. S [R, H, Dk, Dv]; q, k, g [R, H, Dk];
    v [R, H, Dv]; beta [R, H]. Returns (new S, o [R, H, Dv])."""
    S = S * g.exp()[..., None]
    u = (v - torch.einsum("rhkv,rhk->rhv", S, k)) * beta[..., None]
    S = S + k[..., None] * u[..., None, :]
    return S, torch.einsum("rhkv,rhk->rhv", S, q)


def gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over each head's Dv, then · σ(gate), in fp32."""
    o = o.float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return o * torch.sigmoid(gate.float())


@dataclass
class RowGroup:
    rows: list[int]                  # indices into StatePlan.rows
    index: torch.Tensor              # [R, T] flat token of step t of each row, -1 past its end
    parents: torch.Tensor | None     # [R, T] parent step (-1: the committed state); None when all chains


def row_groups(plan: StatePlan) -> tuple[RowGroup | None, RowGroup | None]:
    """(rows that keep all their tokens, verify rows), each padded to its longest row; built once
    per forward and shared by every KDA layer."""
    if "groups" in plan.layouts:
        return plan.layouts["groups"]
    out = []
    for verify in (False, True):
        rows = [i for i, r in enumerate(plan.rows) if r.verify == verify]
        if not rows:
            out.append(None)
            continue
        T = max(plan.rows[i].q_len for i in rows)
        index = torch.full((len(rows), T), -1, dtype=torch.long)
        parents = torch.arange(-1, T - 1).repeat(len(rows), 1)
        tree = False
        for j, i in enumerate(rows):
            r = plan.rows[i]
            index[j, :r.q_len] = torch.arange(r.start, r.start + r.q_len)
            if r.parents is not None:
                parents[j, :r.q_len] = torch.tensor(r.parents)
                tree = True
        dev = plan.slots.device
        out.append(RowGroup(rows, index.to(dev), parents.to(dev) if tree else None))
    plan.layouts["groups"] = tuple(out)
    return plan.layouts["groups"]


def conv_layout(plan: StatePlan, K: int):
    """Where each row's conv window lives in one flat buffer [row 0: K-1 state entries, its new
    tokens; row 1: ...]: (state positions [R, K-1], new-token positions [N], window [N, K] of
    each token through its ancestors, each row's buffer offset)."""
    if ("conv", K) in plan.layouts:
        return plan.layouts[("conv", K)]
    state_pos, new_pos, windows, offsets = [], [], [], []
    off = 0
    for r in plan.rows:
        offsets.append(off)
        state_pos.append(list(range(off, off + K - 1)))
        new_pos.extend(range(off + K - 1, off + K - 1 + r.q_len))
        for t in range(r.q_len):
            path, node = [], t
            while len(path) < K and node >= 0:
                path.append(off + K - 1 + node)
                node = r.parent(node)
            back = off + K - 2                  # the window's older part comes from the state
            while len(path) < K:
                path.append(back)
                back -= 1
            windows.append(path[::-1])
        off += K - 1 + r.q_len
    dev = plan.slots.device
    layout = (torch.tensor(state_pos, dtype=torch.long, device=dev).view(len(plan.rows), K - 1),
              torch.tensor(new_pos, dtype=torch.long, device=dev),
              torch.tensor(windows, dtype=torch.long, device=dev).view(-1, K), offsets, off)
    plan.layouts[("conv", K)] = layout
    return layout


class LayerPending:
    """One KDA layer's results for one forward, until the runner commits each row."""

    def __init__(self, plan: StatePlan, buf: torch.Tensor, offsets: list[int], K: int):
        self.plan, self.buf, self.offsets, self.K = plan, buf, offsets, K
        self.final: dict[int, torch.Tensor] = {}        # row -> state after its last token
        self.hist: list[torch.Tensor] | None = None     # per step t: [Rv, H, Dk, Dv] (snapshot)
        self.verify_pos: dict[int, int] = {}            # row -> its index among the verify rows
        self.inputs: dict[int, tuple] = {}              # row -> (k, v, g, beta) per token (replay)

    def nbytes(self) -> int:
        n = self.buf.nbytes + sum(t.nbytes for t in self.final.values())
        n += sum(t.nbytes for t in self.hist) if self.hist is not None else 0
        return n + sum(t.nbytes for ins in self.inputs.values() for t in ins)

    def commit(self, pool: StatePool, layer: int, row: int, path: list[int]) -> None:
        r = self.plan.rows[row]
        K, off = self.K, self.offsets[row]
        seq = list(range(off, off + K - 1)) + [off + K - 1 + p for p in path]
        pos = torch.tensor(seq[len(seq) - (K - 1):], dtype=torch.long, device=self.buf.device)
        pool.conv[layer, r.slot] = self.buf.index_select(0, pos).t()
        if row in self.final:
            if path[-1] != r.q_len - 1:
                raise ValueError("a prefill or decode row keeps all of its tokens")
            pool.rec[layer, r.slot] = self.final[row]
        elif self.hist is not None:
            pool.rec[layer, r.slot] = self.hist[path[-1]][self.verify_pos[row]]
        else:
            # Replay: the slot still holds the state before this step; run the kept tokens again.
            k, v, g, beta = self.inputs[row]
            p = torch.tensor(path, device=k.device)
            S = pool.rec[layer, r.slot][None]
            for t in p:     # q only shapes the output, which nobody reads here: pass k
                S, _ = delta_step(S, k[t][None], k[t][None], v[t][None], g[t][None], beta[t][None])
            pool.rec[layer, r.slot] = S[0]


def run_group(S0: torch.Tensor, group: RowGroup, q, k, v, g, beta, out: torch.Tensor, keep: bool):
    """The recurrence over one group of rows, in lock step. Writes each token's output into
    `out` [N, H, Dv]; returns (state after each row's last token, the states after each step or None)."""
    cur, hist = S0, []
    for t in range(group.index.shape[1]):
        idx = group.index[:, t]
        act = idx >= 0
        prev = cur
        if group.parents is not None and t > 0:
            par = group.parents[:, t]
            jump = (act & (par != t - 1)).nonzero().flatten().tolist()
            if jump:
                prev = cur.clone()
                for j in jump:
                    p = int(par[j])
                    prev[j] = hist[p][j] if p >= 0 else S0[j]
        ii = idx.clamp(min=0)
        S, o = delta_step(prev, q[ii], k[ii], v[ii], g[ii], beta[ii])
        cur = torch.where(act[:, None, None, None], S, cur)
        out[idx[act]] = o[act]
        if keep:
            hist.append(cur)
    return cur, (hist if keep else None)


class KimiDeltaAttention(nn.Module):
    """Parameter names follow the checkpoints (`q_conv1d`, `f_a_proj`, `A_log`, ...), not
    transformers' regrouped ones, so a folder loads without renaming."""

    def __init__(self, cfg: HybridConfig, hidden: int, eps: float, kda_index: int):
        super().__init__()
        H, D, K = cfg.linear_num_heads, cfg.linear_head_dim, cfg.conv_kernel
        self.heads, self.head_dim, self.kernel, self.eps = H, D, K, eps
        self.kda_index = kda_index
        self.lower_bound = cfg.gate_lower_bound
        C = H * D
        self.q_proj = nn.Linear(hidden, C, bias=False)
        self.k_proj = nn.Linear(hidden, C, bias=False)
        self.v_proj = nn.Linear(hidden, C, bias=False)
        self.q_conv1d = nn.Conv1d(C, C, K, groups=C, bias=False)
        self.k_conv1d = nn.Conv1d(C, C, K, groups=C, bias=False)
        self.v_conv1d = nn.Conv1d(C, C, K, groups=C, bias=False)
        self.f_a_proj = nn.Linear(hidden, D, bias=False)
        self.f_b_proj = nn.Linear(D, C, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(C))
        self.A_log = nn.Parameter(torch.zeros(H))
        self.b_proj = nn.Linear(hidden, H, bias=False)
        if cfg.full_rank_gate:
            self.g_proj = nn.Linear(hidden, C, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, D, bias=False)
            self.g_b_proj = nn.Linear(D, C, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(D))
        self.o_proj = nn.Linear(C, hidden, bias=False)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: torch.Tensor, plan: StatePlan) -> torch.Tensor:
        """x: [N, hidden], the flat tokens of the batch as `plan.rows` lays them out."""
        N = x.shape[0]
        H, D, K, L = self.heads, self.head_dim, self.kernel, self.kda_index
        pool = plan.pool
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1).float()
        state_pos, new_pos, windows, offsets, size = conv_layout(plan, K)
        buf = mixed.new_empty(size, mixed.shape[1])
        buf[state_pos.view(-1)] = pool.conv[L].index_select(0, plan.slots).transpose(1, 2).reshape(-1, mixed.shape[1])
        buf[new_pos] = mixed
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).float().squeeze(1)
        conv = F.silu(torch.einsum("nkc,ck->nc", buf[windows], w))
        q, k, v = (t.reshape(N, H, D) for t in conv.split(H * D, dim=-1))
        q, k = l2norm(q) * D ** -0.5, l2norm(k)
        g = kda_decay(self.f_b_proj(self.f_a_proj(x)).float().view(N, H, D), self.A_log, self.dt_bias,
                      self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())

        pending = LayerPending(plan, buf, offsets, K)
        out = q.new_zeros(N, H, D)
        S0 = pool.rec[L].index_select(0, plan.slots)
        whole, verify = row_groups(plan)
        if whole is not None:
            final, _ = run_group(S0[whole.rows], whole, q, k, v, g, beta, out, keep=False)
            pending.final = {i: final[j] for j, i in enumerate(whole.rows)}
        if verify is not None:
            snapshot = plan.rollback == "snapshot"
            _, hist = run_group(S0[verify.rows], verify, q, k, v, g, beta, out,
                                keep=snapshot or verify.parents is not None)
            pending.verify_pos = {i: j for j, i in enumerate(verify.rows)}
            if snapshot:
                pending.hist = hist
            else:
                for i in verify.rows:
                    r = plan.rows[i]
                    s = slice(r.start, r.start + r.q_len)
                    pending.inputs[i] = (k[s], v[s], g[s], beta[s])
        plan.pending[L] = pending
        o = gated_rms_norm(out, self.o_norm.weight, self.output_gate(x).float().view(N, H, D), self.eps)
        return self.o_proj(o.reshape(N, H * D).to(x.dtype))
