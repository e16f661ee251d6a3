"""MXFP4 weights as compressed-tensors' `mxfp4-pack-quantized` format stores them (Kimi-K3's
routed experts), and the `quantization_config` that says which tensors are stored that way.

The format (OCP Microscaling Formats v1.0: FP4 E2M1 elements, one E8M0 scale per block of 32):

* `X.weight_packed`, uint8 [..., K/2]: two E2M1 codes a byte; element 2i is the LOW nibble of
  byte i, element 2i+1 the high one. A code is s·eem: bit 3 the sign, then the magnitudes
  0, 0.5, 1, 1.5, 2, 3, 4, 6 for 0..7.
* `X.weight_scale`, uint8 [..., K/32]: one E8M0 exponent per 32 consecutive elements along K
  (the input dimension of a Linear); byte e means 2^(e-127), 255 is NaN.
* value = E2M1(code) · 2^(e-127); no zero point, no global scale.

Every value is exactly representable in bfloat16 and float32 (two significant bits times a
power of two), so dequantizing loses nothing. `quantize_mxfp4` is the reverse, as the OCP spec
defines it (section 6.3): the shared exponent of a block is floor(log2(max |v|)) - 2 (2 being
E2M1's largest exponent), each v / 2^shared is rounded to the nearest E2M1 value, ties to the
even code, and magnitudes above 6 saturate to 6. The target loader only dequantizes; the
quantizer is what the tests' release writer uses."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

GROUP = 32
FORMAT = "mxfp4-pack-quantized"
E8M0_BIAS = 127
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(_MAGNITUDES + tuple(-m for m in _MAGNITUDES))   # indexed by the 4-bit code
_MIDPOINTS = torch.tensor([(a + b) / 2 for a, b in zip(_MAGNITUDES, _MAGNITUDES[1:])])


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 exponents -> float32 multipliers 2^(e-127) (255 -> NaN)."""
    out = torch.exp2(scales.to(torch.float32) - E8M0_BIAS)
    return out.masked_fill(scales == 255, float("nan"))


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [..., K/2] and scales uint8 [..., K/32] -> [..., K] in `dtype`.
    Raises ValueError when the two do not describe the same [..., K] tensor."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"packed is {packed.dtype} and scales are {scales.dtype}; both must be uint8")
    if packed.dim() < 1 or packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] * 2 != scales.shape[-1] * GROUP:
        raise ValueError(f"packed shape {tuple(packed.shape)} and scale shape {tuple(scales.shape)} disagree: "
                         f"packed [..., K/2] needs scales [..., K/{GROUP}] with the same leading dims")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()
    values = E2M1_VALUES.to(packed.device)[codes]
    factors = e8m0_to_float(scales).repeat_interleave(GROUP, dim=-1)
    return (values * factors).to(dtype)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """4-bit codes of the E2M1 values nearest `x` (ties to the even code, |x| > 6 -> 6)."""
    mag = x.abs()
    mids = _MIDPOINTS.to(x.device)
    idx = torch.searchsorted(mids, mag.contiguous(), right=False)      # count of midpoints below |x|
    tie = (idx < len(mids)) & (mids[idx.clamp(max=len(mids) - 1)] == mag)
    idx = idx + (tie & (idx % 2 == 1)).long()
    sign = (x < 0) & (idx > 0)                                         # -0 is written as +0
    return (idx | (sign.long() << 3)).to(torch.uint8)


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
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (shared + E8M0_BIAS).to(torch.uint8).contiguous()


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
class Mxfp4Scheme:
    """Which modules a checkpoint may store as MXFP4: a config group's targets, minus `ignore`."""
    targets: tuple[tuple[str, ...], ...]      # one tuple of patterns per config group
    ignore: tuple[str, ...]

    def covers(self, module_name: str, module: nn.Module | None) -> bool:
        """`module_name` is the checkpoint's own spelling (a wrapper's prefix included)."""
        if _matches(list(self.ignore), module_name, module):
            return False
        return any(_matches(list(t), module_name, module) for t in self.targets)


def parse_quantization(raw: dict) -> Mxfp4Scheme | None:
    """The MXFP4 scheme of a config.json (a wrapper's top level or its text_config), None without a
    quantization_config; QuantizationConfigError naming the field for anything but weight-only
    compressed-tensors mxfp4-pack-quantized with groups of 32."""
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
                                      f"'compressed-tensors' ({FORMAT}) checkpoints load")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationConfigError(f"config.json: {where}.config_groups is missing or empty")
    targets = []
    for gname, g in groups.items():
        at = f"{where}.config_groups.{gname}"
        fmt = g.get("format") or qc.get("format")
        if fmt != FORMAT:
            raise QuantizationConfigError(f"config.json: {at}.format is {fmt!r}; only {FORMAT!r} loads")
        w = g.get("weights") or {}
        for key, want in (("num_bits", 4), ("group_size", GROUP), ("type", "float")):
            if w.get(key, want) != want:
                raise QuantizationConfigError(f"config.json: {at}.weights.{key} is {w.get(key)!r}; "
                                              f"{FORMAT} is {key} {want!r}")
        if w.get("symmetric") is False:
            raise QuantizationConfigError(f"config.json: {at}.weights.symmetric is false; {FORMAT} is symmetric")
        if g.get("input_activations") or g.get("output_activations"):
            raise QuantizationConfigError(f"config.json: {at} quantizes activations; only weight-only MXFP4 loads")
        t = g.get("targets")
        if not isinstance(t, list) or not t:
            raise QuantizationConfigError(f"config.json: {at}.targets must be a non-empty list")
        targets.append(tuple(t))
    return Mxfp4Scheme(targets=tuple(targets), ignore=tuple(qc.get("ignore") or ()))
