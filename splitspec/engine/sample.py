"""Sampling: temperature, then top-k, then top-p (the order FlashInfer's
`top_k_top_p_sampling_from_logits` uses by default), renormalising after each filter.

Two ways to draw a token at T > 0 (`SamplingParams.coupled`):

* **coupled** (the default): Gumbel-max with noise keyed by (seed, absolute position, token id),
  `token = argmax over the kept set of logits / T + g`. The draw at a position depends on
  nothing but that key and the logits, so target-only decoding, any drafter's verify, a
  failover's re-prefill and a prefix-cache hit all emit the same token for the same seed;
* **stream**: inverse-CDF draws from a per-request `torch.Generator`, consumed in call order
  (a seed reproduces a request only when it runs the same way again).

The noise (`gumbel`) is written down here rather than taken from a library generator, whose
stream may change between releases or devices: a per-position key from SplitMix64 in Python
integers, then per token two keyed rounds of a 32-bit mixer held in int64 tensors (multipliers
below 2^31, so no operation leaves int64's range on any device), two such words giving a
52-bit uniform. `tests/test_coupled.py` pins known values."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitspec.limits import MAX_LOGPROBS


# Unset (proto SAMPLER_UNSPECIFIED, or SamplingParams built without it): coupled.
COUPLED_BY_DEFAULT = True


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0    # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0              # 0 = off
    seed: int | None = None
    # Coupled (Gumbel-max, position-keyed noise) or stream sampling at T > 0; see the module doc.
    coupled: bool = COUPLED_BY_DEFAULT
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
        if self.seed is not None and not 0 <= self.seed <= MASK64:
            raise ValueError(f"seed must be in [0, 2^64 - 1], got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        return self


MASK64 = (1 << 64) - 1
MASK32 = (1 << 32) - 1
UNIFORM_BITS = 52     # 26 from each of two 32-bit words: (m + 0.5) / 2^52 is exact in float64 and never 0 or 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def noise_key(seed: int, position: int) -> int:
    """The 64-bit key of one position of one request."""
    if not 0 <= seed <= MASK64:
        raise ValueError(f"seed must be in [0, 2^64 - 1], got {seed}")
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    return _splitmix64((_splitmix64(seed) + position) & MASK64)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2^32) with good avalanche (the shift / multiply / shift / multiply /
    shift shape of murmur3's finaliser; multipliers from Wellons' hash-prospector search). Both
    multipliers are below 2^31, so every product of a 32-bit word stays below 2^63: int64 never
    overflows, whose wrap-around torch does not promise on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & MASK32
    return x ^ (x >> 15)


def noise_uniform(seed: int, position: int, token_ids: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), float64, one per token id: 52 bits from two hashed 32-bit words. Within a
    position each word is a bijection of the token id (key, mix, key, mix), so no two tokens
    share a u."""
    key = noise_key(seed, position)
    t = token_ids.to(torch.int64)
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"token ids must be >= 0, got {int(t.min())}")
    keys = [_splitmix64((key + w) & MASK64) for w in (0, 1)]
    lo = torch.tensor([[k & MASK32] for k in keys], dtype=torch.int64, device=t.device)
    hi = torch.tensor([[k >> 32] for k in keys], dtype=torch.int64, device=t.device)
    words = _mix32(_mix32((t & MASK32) ^ lo) ^ hi)                  # [2, n]
    m = (words[0] >> 6) * (1 << 26) + (words[1] >> 6)
    return (m.double() + 0.5) * 2.0 ** -UNIFORM_BITS


def gumbel(seed: int, position: int, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise, float64, for these token ids at this position of this request."""
    return -torch.log(-torch.log(noise_uniform(seed, position, token_ids)))


def gumbel_argmax(scores: torch.Tensor, token_ids: torch.Tensor, seed: int, position: int) -> int:
    """The token id among `token_ids` maximising scores + g: an exact draw from softmax(scores)
    over those ids. Scores are log-probabilities up to a constant (logits / T, or log q)."""
    noisy = scores.double() + gumbel(seed, position, token_ids).to(scores.device)
    return int(token_ids[int(noisy.argmax())])


def coupled_sample(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """One token from a row of logits [V] at an absolute position: Gumbel-max over the tokens
    temperature / top-k / top-p keep (the noise is computed for those only: V tokens without a
    filter, about 40 integer passes over them)."""
    if params.greedy:
        return int(logits.argmax(-1))
    kept = (probs_from_logits(logits, params) > 0).nonzero()[:, 0]
    return gumbel_argmax(logits[kept].double() / params.temperature, kept, seed, position)


def draft_stream_seed(seed: int) -> int:
    """The seed of a draft's own random stream in stream mode. Not the request's seed: the target
    draws its acceptance coins from that stream, and a draft drawing its tokens from the same
    numbers would choose them knowing the coins that test them, which biases min(1, p/q)."""
    return _splitmix64(seed ^ 0x6472616674)


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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           position: int | None = None) -> int:
    """Sample one token from a single row of logits [V] predicting absolute position `position`.
    Coupled sampling keys its noise by the generator's seed (the request's, or the random one
    it was made with) and the position; stream sampling draws from the generator."""
    if params.greedy:
        return int(logits.argmax(-1))
    if params.coupled:
        if position is None:
            raise ValueError("coupled sampling needs the position of the token it samples")
        return coupled_sample(logits, params, generator.initial_seed(), position)
    return sample_from_probs(probs_from_logits(logits, params), generator)
