"""Sampling: temperature, then top-k, then top-p (the order FlashInfer's
`top_k_top_p_sampling_from_logits` uses by default), renormalising after each filter.
Every random draw goes through a per-request `torch.Generator`, so a seed reproduces a
request's output exactly."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitspec.limits import MAX_LOGPROBS


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0    # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0              # 0 = off
    seed: int | None = None
    # Logit processors (splitspec/engine/penalties.py), vLLM's meanings; all off by default.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()    # made impossible before min_tokens (with eos unless ignore_eos)
    ignore_eos: bool = False
    # Log-probs to report (of the raw model distribution); None = none.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes(self) -> bool:
        """Whether the logits need processing before sampling (the fast path skips it)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def validate(self) -> "SamplingParams":
        if not self.temperature >= 0.0 or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0.0 or self.repetition_penalty == float("inf"):
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {bias}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        return self


def make_generator(seed: int | None, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the target samples from, [..., V] float32 rows summing to 1.
    Greedy returns a one-hot of the argmax, so verification code has one shape to handle."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_k and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass
        # strictly before it is still below top_p.
        before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = torch.where(before < params.top_p, sorted_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw from one row of probabilities (float32/64, sums to ~1)."""
    u = torch.rand((), generator=generator, device=probs.device, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    idx = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    idx = min(idx, probs.shape[-1] - 1)
    # Never land on a zero-probability token through rounding at the top of the CDF.
    while probs[idx] <= 0 and idx > 0:
        idx -= 1
    return idx


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Sample one token from a single row of logits [V]."""
    if params.greedy:
        return int(logits.argmax(-1))
    return sample_from_probs(probs_from_logits(logits, params), generator)
