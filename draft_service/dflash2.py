"""DFlash2 drafter: the DFlash backbone plus two modules (the public `DFlash2DraftModel` layout).

* A grouped two-tap **dynamic depthwise convolution** around every attention and MLP
  sublayer: norm -> conv prepare -> sublayer -> conv finish -> residual. It runs over the
  block's own rows only (anchor + masks), causal within the block, zero before the block
  start, so no state crosses steps and the injected context is never convolved. Each
  position's taps are a static per-channel kernel plus a correction projected from that
  position's sublayer input and shared by the channels of a group.
* A low-rank **candidate selector**: the unary logits (the target's lm_head on the draft
  hidden, times `output_multiplier`, then tanh-softcapped) keep K candidates per position,
  and S_t(a, b) = U_t(b) + <A[a] * W_h h_t, B[b]> scores candidate b after predecessor a.
  Drafting walks the block left to right: argmax at T=0; at T>0 a draw from
  q_t = softmax(S_t(y_{t-1}, .)/T) over the candidates, the q the target verifies with.

Checkpoint: `architectures: ["DFlash2DraftModel"]`, DFlash2 fields under `dflash_config`
(block_size, conv_group_size, conv_kernel_size, selector_rank, selector_top_k,
output_multiplier, final_logit_softcapping, mask_token_id, target_layer_ids);
tensors `layers.{i}.{attention,mlp}_conv.{base_kernel,kernel_projection.weight}` and
`candidate_selector.{predecessor_codebook,successor_codebook}` (bare keys, no `.weight`),
`candidate_selector.hidden_projection.weight`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitspec.engine.sample import gumbel, sample_from_probs
from splitspec.models.config import ConfigError

from .dflash import DFlashConfig, DFlashDraft, DraftLayer, mlp

DFLASH2_FIELDS = ("block_size", "conv_group_size", "conv_kernel_size", "selector_rank", "selector_top_k",
                  "output_multiplier", "final_logit_softcapping", "mask_token_id", "target_layer_ids",
                  "attention_mode", "causal", "aux_hidden_stream")


@dataclass(frozen=True)
class DFlash2Config(DFlashConfig):
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    ARCHITECTURE = "DFlash2DraftModel"

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    @classmethod
    def from_dict(cls, raw: dict, *, block_size_means: str = "verify_width") -> "DFlash2Config":
        fields = cls.fields_from_dict(raw, block_size_means)
        dcfg = raw.get("dflash_config") or {}
        unknown = sorted(set(dcfg) - set(DFLASH2_FIELDS))
        if unknown:
            raise ConfigError(f"draft config.json: dflash_config.{unknown[0]} is not supported by this "
                              f"DFlash2 loader (known: {', '.join(DFLASH2_FIELDS)})")
        for key in ("conv_group_size", "conv_kernel_size", "selector_rank", "selector_top_k"):
            if key not in dcfg:
                raise ConfigError(f"draft config.json: dflash_config.{key} is missing")
            if not isinstance(dcfg[key], int) or dcfg[key] <= 0:
                raise ConfigError(f"draft config.json: dflash_config.{key} must be a positive integer, "
                                  f"got {dcfg[key]!r}")
        cap = dcfg.get("final_logit_softcapping")
        cfg = cls(**fields, conv_kernel_size=dcfg["conv_kernel_size"], conv_group_size=dcfg["conv_group_size"],
                  selector_rank=dcfg["selector_rank"], selector_top_k=dcfg["selector_top_k"],
                  output_multiplier=float(dcfg.get("output_multiplier") or 1.0),
                  final_logit_softcapping=float(cap) if cap else None)
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.hidden_size % self.conv_group_size:
            raise ConfigError(f"draft config.json: dflash_config.conv_group_size={self.conv_group_size} must "
                              f"divide hidden_size={self.hidden_size}")
        if self.selector_top_k > self.head_size:
            raise ConfigError(f"draft config.json: dflash_config.selector_top_k={self.selector_top_k} exceeds "
                              f"the head's {self.head_size} tokens")
        if self.output_multiplier <= 0:
            raise ConfigError(f"draft config.json: dflash_config.output_multiplier must be positive, "
                              f"got {self.output_multiplier}")

    def to_dict(self) -> dict:
        """The public layout: every DFlash2 field, block_size included, under dflash_config."""
        out = super().to_dict()
        block = out.pop("block_size")
        out["dflash_config"].update(block_size=block, conv_group_size=self.conv_group_size,
                                    conv_kernel_size=self.conv_kernel_size, selector_rank=self.selector_rank,
                                    selector_top_k=self.selector_top_k, output_multiplier=self.output_multiplier,
                                    final_logit_softcapping=self.final_logit_softcapping)
        return out


def grouped_dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block: int) -> torch.Tensor:
    """out[t, c] = sum_tau (base[tau, c] + dynamic[t, tau, group(c)]) * x[t - tau, c] within each
    block of `block` consecutive rows (x[t - tau] = 0 before the block start).
    x: [..., T, H] with T a multiple of `block`; dynamic: [..., T, k, G]; base: [k, H]."""
    *lead, T, H = x.shape
    k, G = dynamic.shape[-2], dynamic.shape[-1]
    xb = x.reshape(-1, block, G, H // G)                        # rows of one block, channels by group
    db = dynamic.reshape(-1, block, k, G, 1)
    out = torch.zeros_like(xb)
    for tau in range(k):
        shifted = xb if tau == 0 else F.pad(xb[:, :-tau], (0, 0, 0, 0, tau, 0))
        out = out + (base[tau].view(1, 1, G, H // G).to(x.dtype) + db[:, :, tau]) * shifted
    return out.reshape(*lead, T, H)


class GroupedDynamicConv(nn.Module):
    """One sublayer's conv pair: `prepare` before it and `finish` after it, both with kernels
    projected once from the sublayer input."""

    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.k, self.groups, self.block = cfg.conv_kernel_size, cfg.conv_groups, cfg.block_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.k, cfg.hidden_size))
        self.kernel_projection = nn.Linear(cfg.hidden_size, 2 * self.k * self.groups, bias=False)

    def reset_identity(self) -> None:
        """Tap 0 = 1, other taps and the projection 0: the sublayer runs exactly as in DFlash."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.kernel_projection(u).view(*u.shape[:-1], 2, self.k, self.groups)
        return grouped_dynamic_conv(u, d[..., 0, :, :], self.base_kernel[0], self.block), d[..., 1, :, :]

    def finish(self, y: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_conv(y, d, self.base_kernel[1], self.block)


class DFlash2Layer(DraftLayer):
    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        self.attention_conv = GroupedDynamicConv(cfg)
        self.mlp_conv = GroupedDynamicConv(cfg)

    def forward(self, x, attend):
        v, d = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(attend(self.self_attn, v), d)
        v, d = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(mlp(self.mlp, v), d)


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def candidates(self, unary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, unary scores) [..., K] of the K best unary logits, best first."""
        scores, ids = torch.topk(unary.float(), self.top_k, dim=-1)
        return ids, scores

    def scores(self, h: torch.Tensor, pred: torch.Tensor, cand: torch.Tensor, unary: torch.Tensor) -> torch.Tensor:
        """S(a, b) = U(b) + <A[a] * W_h h, B[b]>. h [..., H]; pred [...] (a); cand, unary [..., K]."""
        gate = self.predecessor_codebook[pred] * self.hidden_projection(h)                  # [..., r]
        pair = torch.einsum("...r,...kr->...k", gate.float(), self.successor_codebook[cand].float())
        return unary + pair


class DFlash2Draft(DFlashDraft):
    layer_class = DFlash2Layer

    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Unary logits: multiplier first, then the soft cap (the reference order), on the head's
        own columns, so the tokens a reduced head leaves out stay at -inf in `logits`."""
        z = super().draft_logits(h)
        if self.cfg.output_multiplier != 1.0:        # a full [rows, V] pass saved when it is 1
            z = z * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return z if not cap else cap * torch.tanh(z / cap)

    def walk(self, h: torch.Tensor, unary: torch.Tensor, anchor: int, n: int, temperature: float = 0.0,
             generator: torch.Generator | None = None, guide=None,
             noise: tuple[int, int] | None = None) -> tuple[list[int], torch.Tensor | None]:
        """The chain of n tokens one block drafts, and q [n, V] when sampled.
        h [B-1, H] final normed hidden and unary [B-1, V] logits of the mask slots.
        guide: a structured-output grammar (splitspec.grammar.Guide): each position chooses
        among the candidates it allows after the chain so far (q renormalised over them, which is
        what the token is drawn from, so the verifier's test stays exact); the chain stops where
        none is allowed or the grammar ends. The guide's state is left as it was.
        noise: (seed, absolute position of the chain's first token) for coupled sampling: step t
        takes argmax(log q + g) with g the target's Gumbel noise at that position for each
        candidate's token id, instead of a draw from the generator."""
        if guide is not None:
            steps = []
            try:
                return self._walk(h, unary, anchor, n, temperature, generator, guide, steps, noise)
            finally:
                if steps:
                    guide.matcher.rollback(len(steps))
        return self._walk(h, unary, anchor, n, temperature, generator, None, [], noise)

    def _walk(self, h, unary, anchor, n, temperature, generator, guide, steps, noise=None):
        sel = self.candidate_selector
        cand, u = sel.candidates(unary[:n])                                  # [n, K]
        gate = sel.hidden_projection(h[:n]).float()                          # [n, r]
        succ = sel.successor_codebook[cand].float()                          # [n, K, r]
        pred_book = sel.predecessor_codebook
        prev, chain, qs = anchor, [], []
        for t in range(n):
            s = u[t] + succ[t] @ (pred_book[prev].float() * gate[t])
            if guide is not None:
                ok = None if guide.done else guide.allowed().to(cand.device)[cand[t]]
                if ok is None or not bool(ok.any()):
                    break
                s = s.masked_fill(~ok, float("-inf"))
            if temperature > 0:
                q = torch.softmax(s / temperature, -1)
                if noise is None:
                    j = sample_from_probs(q, generator)
                else:
                    # A candidate masked out (-inf) stays out: -inf + g never wins.
                    g = gumbel(noise[0], noise[1] + t, cand[t]).to(s.device)
                    j = int((s.double() / temperature + g).argmax())
                qs.append(torch.zeros(unary.shape[-1], device=q.device).index_put_((cand[t],), q))
            else:
                j = int(torch.argmax(s))
            prev = int(cand[t, j])
            if guide is not None:
                if not guide.matcher.accept_token(prev):
                    qs = qs[:len(chain)]
                    break
                steps.append(prev)
            chain.append(prev)
        return chain, torch.stack(qs) if qs else None


def new_dflash2(base: DFlashDraft | DFlashConfig, *, conv_group_size: int = 16, conv_kernel_size: int = 2,
                selector_rank: int = 64, selector_top_k: int = 16, output_multiplier: float = 1.0,
                final_logit_softcapping: float | None = None, seed: int = 0) -> DFlash2Draft:
    """A DFlash2 draft with the backbone of `base` (a trained DFlash draft: its weights are copied,
    a warm start) or of a DFlash config (random backbone). Convs start as the identity and the
    successor codebook at zero, so the new draft drafts exactly as its DFlash backbone until
    trained (the selector adds 0 to the unary scores)."""
    bcfg = base.cfg if isinstance(base, DFlashDraft) else base
    fields = {f: getattr(bcfg, f) for f in DFlashConfig.__dataclass_fields__}
    fields["is_causal"] = bool(bcfg.is_causal)      # explicit, as public DFlash2 checkpoints write it
    cfg = DFlash2Config(**fields, conv_group_size=conv_group_size, conv_kernel_size=conv_kernel_size,
                        selector_rank=selector_rank, selector_top_k=selector_top_k,
                        output_multiplier=output_multiplier, final_logit_softcapping=final_logit_softcapping)
    cfg.check()
    torch.manual_seed(seed)
    model = DFlash2Draft(cfg)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    sel = model.candidate_selector
    with torch.no_grad():
        # The pair score is a product of three learned factors; with all of them at the usual 0.02
        # scale its gradients start ~1e4 times smaller than the unary ones and the selector barely
        # moves in a short warm start. Unit-scale predecessor codes and a projection that keeps
        # the normed hidden at unit scale make the gate O(1); the successor codebook at zero keeps
        # the starting scores exactly the unary ones.
        nn.init.normal_(sel.predecessor_codebook, std=1.0)
        nn.init.normal_(sel.hidden_projection.weight, std=cfg.hidden_size ** -0.5)
        sel.successor_codebook.zero_()
        for layer in model.layers:
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()
    if isinstance(base, DFlashDraft):
        missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
        assert not unexpected, unexpected
        if base._target:
            model.attach_target(base._target["embed"], base._target["lm_head"])
    return model
