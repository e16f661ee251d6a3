"""FP4 weights as compressed-tensors stores them, kept packed in memory: `mxfp4-pack-quantized`
(Kimi-K3's routed experts) and `nvfp4-pack-quantized`, the `quantization_config` that says which
tensors are stored so, and `PackedLinear`, a linear layer that holds its weight packed and
dequantizes it only when it runs (a routed expert: only when a batch routes tokens to it).

Both formats store FP4 E2M1 codes two a byte in `X.weight_packed`, uint8 [..., K/2]: element 2i
is the LOW nibble of byte i, element 2i+1 the high one. A code is s·eem: bit 3 the sign, then the
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for 0..7. K is the input dimension of a Linear.

* MXFP4 (OCP Microscaling v1.0): `X.weight_scale`, uint8 [..., K/32], one E8M0 exponent per 32
  elements; byte e means 2^(e-127), 255 is NaN. value = E2M1(code) · 2^(e-127).
* NVFP4: `X.weight_scale`, float8_e4m3fn [..., K/16], one scale per 16 elements, and
  `X.weight_global_scale`, float32 [1], stored as the reciprocal of the tensor's multiplier:
  value = E2M1(code) · scale / global_scale (compressed-tensors' `dequantize`).

Every MXFP4 value is exactly representable in bfloat16 and float32 (two significant bits times a
power of two), so dequantizing loses nothing. `quantize_mxfp4` is the reverse, as the OCP spec
defines it (section 6.3): the shared exponent of a block is floor(log2(max |v|)) - 2 (2 being
E2M1's largest exponent), each v / 2^shared is rounded to the nearest E2M1 value, ties to the
even code, and magnitudes above 6 saturate to 6. The target only dequantizes; the quantizers are
what the tests' checkpoint writers use."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from torch import nn

GROUP = 32                       # MXFP4 elements per scale
NV_GROUP = 16                    # NVFP4 elements per scale
FORMAT = "mxfp4-pack-quantized"
NV_FORMAT = "nvfp4-pack-quantized"
GROUPS = {FORMAT: GROUP, NV_FORMAT: NV_GROUP}
E8M0_BIAS = 127
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(_MAGNITUDES + tuple(-m for m in _MAGNITUDES))   # indexed by the 4-bit code
_MIDPOINTS = torch.tensor([(a + b) / 2 for a, b in zip(_MAGNITUDES, _MAGNITUDES[1:])])


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents -> float32 multipliers 2^(e-127) (255 -> NaN)."""
    out = torch.exp2(scales.to(torch.float32) - E8M0_BIAS)
    return out.masked_fill(scales == 255, float("nan"))


def _check_pair(packed: torch.Tensor, scales: torch.Tensor, group: int, scale_dtype: torch.dtype) -> None:
    if packed.dtype != torch.uint8 or scales.dtype != scale_dtype:
        raise ValueError(f"packed is {packed.dtype} and scales are {scales.dtype}; packed must be uint8 and "
                         f"scales {scale_dtype}")
    if packed.dim() < 1 or packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] * 2 != scales.shape[-1] * group:
        raise ValueError(f"packed shape {tuple(packed.shape)} and scale shape {tuple(scales.shape)} disagree: "
                         f"packed [..., K/2] needs scales [..., K/{group}] with the same leading dims")


# The two E2M1 values of every byte, low nibble first: one table lookup decodes a byte.
_BYTE_VALUES = torch.stack([E2M1_VALUES[torch.arange(256) & 0x0F], E2M1_VALUES[torch.arange(256) >> 4]], -1)


@functools.lru_cache(maxsize=None)
def _byte_values(device: torch.device) -> torch.Tensor:
    """The table on `device`, copied there once (an expert's forward runs it every step)."""
    return _BYTE_VALUES.to(device)


def _e2m1(packed: torch.Tensor, group: int) -> torch.Tensor:
    """packed uint8 [..., K/2] -> the E2M1 values [..., K / group, group] (float32). An embedding
    lookup of each byte's value pair: 2.7x faster on this CPU than splitting the nibbles first."""
    values = nn.functional.embedding(packed.int(), _byte_values(packed.device))         # [..., K/2, 2]
    return values.view(*packed.shape[:-1], packed.shape[-1] * 2 // group, group)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [..., K/2] and scales uint8 [..., K/32] -> [..., K] in `dtype`.
    Raises ValueError when the two do not describe the same [..., K] tensor."""
    _check_pair(packed, scales, GROUP, torch.uint8)
    return _e2m1(packed, GROUP).mul_(e8m0_to_float(scales)[..., None]).flatten(-2).to(dtype)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [..., K/2], scales float8_e4m3fn [..., K/16] and the stored global scale (one
    value: the reciprocal of the multiplier) -> [..., K] in `dtype`."""
    _check_pair(packed, scales, NV_GROUP, torch.float8_e4m3fn)
    if global_scale.numel() != 1:
        raise ValueError(f"global scale has {global_scale.numel()} values; NVFP4 has one per tensor")
    factors = scales.to(torch.float32) / global_scale.to(torch.float32).reshape(())
    return _e2m1(packed, NV_GROUP).mul_(factors[..., None]).flatten(-2).to(dtype)


def dequantize(fmt: str, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if fmt == NV_FORMAT:
        if global_scale is None:
            raise ValueError("an NVFP4 tensor needs its global scale")
        return dequantize_nvfp4(packed, scales, global_scale, dtype)
    return dequantize_mxfp4(packed, scales, dtype)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """4-bit codes of the E2M1 values nearest `x` (ties to the even code, |x| > 6 -> 6)."""
    mag = x.abs()
    mids = _MIDPOINTS.to(x.device)
    idx = torch.searchsorted(mids, mag.contiguous(), right=False)      # count of midpoints below |x|
    tie = (idx < len(mids)) & (mids[idx.clamp(max=len(mids) - 1)] == mag)
    idx = idx + (tie & (idx % 2 == 1)).long()
    sign = (x < 0) & (idx > 0)                                         # -0 is written as +0
    return (idx | (sign.long() << 3)).to(torch.uint8)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float [..., K] (K a multiple of 16) -> (packed uint8 [..., K/2], scales float8_e4m3fn
    [..., K/16], global scale float32 [1]) as compressed-tensors writes NVFP4: the global scale is
    448·6 / amax (stored so), a block's scale amax_block / 6 · global in E4M3, codes the nearest
    E2M1 values of v · global / scale."""
    if w.dim() < 1 or w.shape[-1] % NV_GROUP:
        raise ValueError(f"shape {tuple(w.shape)}: the last dimension must be a multiple of {NV_GROUP}")
    x = w.detach().to(torch.float32)
    amax = x.abs().amax().clamp(min=1e-12)
    global_scale = (448.0 * 6.0 / amax).reshape(1)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // NV_GROUP, NV_GROUP)
    scales = (blocks.abs().amax(-1) / 6.0 * global_scale).clamp(max=448.0).to(torch.float8_e4m3fn)
    step = scales.to(torch.float32) / global_scale
    codes = _round_e2m1(torch.where(step[..., None] > 0, blocks / step[..., None], 0.0)).reshape(x.shape)
    return _pack(codes), scales.contiguous(), global_scale


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., K] (K a multiple of 32) -> (packed uint8 [..., K/2], scales uint8 [..., K/32])."""
    if w.dim() < 1 or w.shape[-1] % GROUP:
        raise ValueError(f"shape {tuple(w.shape)}: the last dimension must be a multiple of {GROUP}")
    x = w.detach().to(torch.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    amax = blocks.abs().amax(-1)
    # floor(log2(amax)) exactly: amax = m * 2^e with m in [0.5, 1). An all-zero block takes the
    # smallest scale (any scale encodes zeros).
    _, e = torch.frexp(amax)
    shared = torch.where(amax > 0, e.to(torch.int32) - 1 - 2, torch.full_like(e, -E8M0_BIAS, dtype=torch.int32))
    shared = shared.clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = _round_e2m1(blocks / torch.exp2(shared.to(torch.float32))[..., None]).reshape(x.shape)
    return _pack(codes), (shared + E8M0_BIAS).to(torch.uint8).contiguous()


# ---- quantization_config -------------------------------------------------------------------------

class QuantizationConfigError(ValueError):
    pass


def _matches(patterns: list[str], name: str, module: nn.Module | None) -> bool:
    """compressed-tensors' target / ignore matching: `re:<regex>` matched from the start of the
    module name, a class name (`Linear` covers every nn.Linear), or the exact module name."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p == name:
            return True
        elif module is not None and (type(module).__name__ == p or (p == "Linear" and isinstance(module, nn.Linear))):
            return True
    return False


@dataclass(frozen=True)
class Fp4Scheme:
    """Which modules a checkpoint may store as FP4, and in which format: each config group's
    targets (with its format), minus `ignore`."""
    targets: tuple[tuple[str, ...], ...]      # one tuple of patterns per config group
    ignore: tuple[str, ...]
    formats: tuple[str, ...] = ()             # the format of each group (MXFP4 when absent)

    def format_of(self, module_name: str, module: nn.Module | None) -> str | None:
        """The format `module_name` (the checkpoint's own spelling, a wrapper's prefix included)
        may be stored in, or None when no group covers it."""
        if _matches(list(self.ignore), module_name, module):
            return None
        for i, t in enumerate(self.targets):
            if _matches(list(t), module_name, module):
                return self.formats[i] if self.formats else FORMAT
        return None

    def covers(self, module_name: str, module: nn.Module | None) -> bool:
        return self.format_of(module_name, module) is not None


Mxfp4Scheme = Fp4Scheme


def parse_quantization(raw: dict) -> Fp4Scheme | None:
    """The FP4 scheme of a config.json (a wrapper's top level or its text_config), None without a
    quantization_config; QuantizationConfigError naming the field for anything but weight-only
    compressed-tensors mxfp4-pack-quantized (groups of 32) or nvfp4-pack-quantized (groups of 16)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    qc, where = text.get("quantization_config"), "text_config.quantization_config"
    if qc is None:
        qc, where = raw.get("quantization_config"), "quantization_config"
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantizationConfigError(f"config.json: {where} must be an object")
    if qc.get("quant_method") != "compressed-tensors":
        raise QuantizationConfigError(f"config.json: {where}.quant_method is {qc.get('quant_method')!r}; only "
                                      f"'compressed-tensors' ({FORMAT} or {NV_FORMAT}) checkpoints load")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationConfigError(f"config.json: {where}.config_groups is missing or empty")
    targets, formats = [], []
    for gname, g in groups.items():
        at = f"{where}.config_groups.{gname}"
        fmt = g.get("format") or qc.get("format")
        if fmt not in GROUPS:
            raise QuantizationConfigError(f"config.json: {at}.format is {fmt!r}; only {FORMAT!r} and {NV_FORMAT!r} load")
        w = g.get("weights") or {}
        for key, want in (("num_bits", 4), ("group_size", GROUPS[fmt]), ("type", "float")):
            if w.get(key, want) != want:
                raise QuantizationConfigError(f"config.json: {at}.weights.{key} is {w.get(key)!r}; "
                                              f"{fmt} is {key} {want!r}")
        if w.get("symmetric") is False:
            raise QuantizationConfigError(f"config.json: {at}.weights.symmetric is false; {fmt} is symmetric")
        if g.get("input_activations") or g.get("output_activations"):
            raise QuantizationConfigError(f"config.json: {at} quantizes activations; only weight-only FP4 "
                                          f"({fmt} weights, activations in the model's dtype) loads")
        t = g.get("targets")
        if not isinstance(t, list) or not t:
            raise QuantizationConfigError(f"config.json: {at}.targets must be a non-empty list")
        targets.append(tuple(t))
        formats.append(fmt)
    return Fp4Scheme(targets=tuple(targets), ignore=tuple(qc.get("ignore") or ()), formats=tuple(formats))


class PackedLinear(nn.Module):
    """A bias-free linear layer whose weight stays packed FP4 (the checkpoint's own bytes):
    `forward` dequantizes it into a transient [out, in] matrix in the input's dtype and drops it
    after the product. As a routed expert it runs only when a batch routes tokens to it, so a
    forward holds at most the routed experts' weights dequantized, one at a time; the model holds
    ~4.25 (MXFP4) or ~4.5 (NVFP4) bits a weight instead of 32."""

    def __init__(self, in_features: int, out_features: int, fmt: str = FORMAT):
        super().__init__()
        group = GROUPS[fmt]
        if in_features % group:
            raise ValueError(f"{fmt}: in_features {in_features} is not a multiple of {group}")
        self.in_features, self.out_features, self.format = in_features, out_features, fmt
        scale_dtype = torch.float8_e4m3fn if fmt == NV_FORMAT else torch.uint8
        frozen = dict(requires_grad=False)
        self.weight_packed = nn.Parameter(torch.zeros(out_features, in_features // 2, dtype=torch.uint8), **frozen)
        self.weight_scale = nn.Parameter(torch.zeros(out_features, in_features // group, dtype=scale_dtype), **frozen)
        if fmt == NV_FORMAT:
            self.weight_global_scale = nn.Parameter(torch.ones(1), **frozen)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) must move these, never convert them: the bytes are codes, the NVFP4
        # scales E4M3 and its global scale float32 (bf16 would round it).
        kept = {n: p.dtype for n, p in self.named_parameters(recurse=False)}
        super()._apply(fn, recurse)
        for n, p in self.named_parameters(recurse=False):
            if p.dtype != kept[n]:
                p.data = p.data.to(kept[n])
        return self

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.format, self.weight_packed, self.weight_scale,
                          getattr(self, "weight_global_scale", None), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantized(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"
