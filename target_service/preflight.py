"""Memory preflight: before anything is loaded, what each rank of a target will hold (routed
experts as stored, packed FP4 or not; the dense trunk in the serving dtype; the KV pool; the
KDA state slots; a runtime reserve), computed from config.json and the safetensors headers
alone (never the tensors), against the memory of the device. A target that would not fit is
refused at once, naming the numbers and what to change.

Each tensor's share of a rank follows the sharding `parallel.py` applies at tensor parallel
size W: the vocabulary rows of the embedding and head ceil(V / W); every expert, shared
expert and dense MLP, the attention heads of MLA and KDA (and their convolutions, decay and
gates), o_proj: 1 / W; a dense model's K/V heads kv_local / kv; everything else (norms, the
router, MLA's latent down-projections, KDA's low-rank f_a / g_a, K3's latent MoE projections)
whole on every rank. `tests/test_fp4_experts.py` holds the estimate equal to the bytes the
loaded ranks hold."""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from splitspec.models.config import ModelConfig
from splitspec.models.hybrid_weights import ignored
from splitspec.models.loader import PACKED_PARTS, model_folder, parse_dtype, weight_files

# safetensors dtype names -> bytes per element
ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                 "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
# kept in float32 whatever the serving dtype (HybridLM.fp32_parameters)
FP32_KEPT = ("gate.weight", "e_score_correction_bias", "dt_bias", "A_log")
SPLIT_LEAVES = {"q_proj", "k_proj", "v_proj", "o_proj", "q_b_proj", "kv_b_proj", "g_proj", "g_b_proj", "b_proj",
                "f_b_proj", "q_conv1d", "k_conv1d", "v_conv1d", "dt_bias", "A_log", "gate_proj", "up_proj",
                "down_proj", "w1", "w2", "w3"}
GIB = 1024 ** 3


def fmt(b: int) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / 2 ** 20:.1f} MiB"


class PreflightError(RuntimeError):
    """The target does not fit the device: the message has the numbers and what to change."""


def read_header(file: Path) -> dict[str, dict]:
    """The safetensors header of `file`: tensor name -> {dtype, shape, data_offsets}; for a
    GGUF file, each tensor's shape under our names (its size is counted in the serving dtype,
    which is what dequantizing at load makes of it)."""
    if Path(file).suffix == ".gguf":
        from splitspec.models.loader import open_weights
        with open_weights(file) as w:
            return {name: {"dtype": t.tensor_type.name, "shape": [int(d) for d in reversed(t.shape.tolist())]}
                    for name, t in w.tensors.items()}
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


@dataclass
class RankMemory:
    world: int
    dtype: str
    experts: int = 0            # routed experts, as stored (packed bytes for FP4)
    experts_dequantized: int = 0   # what the same experts would take in the serving dtype
    trunk: int = 0              # everything else: attention, dense MLP, shared experts, embedding, head, norms
    kv: int = 0                 # the KV pool (--kv-cache-budget-mb)
    state: int = 0              # KDA recurrent + conv state, one slot per running session
    reserve: int = 0            # activations, workspace, allocator slack
    device: int = 0             # what the device offers
    device_name: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.experts + self.trunk + self.kv + self.state + self.reserve

    @property
    def fits(self) -> bool:
        return self.device <= 0 or self.total <= self.device

    def table(self) -> str:
        rows = [("routed experts (as stored)", self.experts), ("dense trunk", self.trunk), ("KV pool", self.kv),
                ("KDA state slots", self.state), ("runtime reserve", self.reserve), ("total per rank", self.total)]
        if self.device > 0:
            rows.append((f"device ({self.device_name})", self.device))
        width = max(len(r[0]) for r in rows)
        lines = [f"per rank at tensor parallel size {self.world}, {self.dtype}:"]
        lines += [f"  {name:<{width}}  {fmt(b):>12}" for name, b in rows]
        if self.experts_dequantized > self.experts:
            lines.append(f"  (the routed experts dequantized to {self.dtype} would take {fmt(self.experts_dequantized)})")
        return "\n".join(lines + [f"  {n}" for n in self.notes])


def _share(name: str, cfg: ModelConfig, world: int) -> float:
    """The fraction of checkpoint tensor `name` one rank holds (see the module docstring)."""
    parts = name.split(".")
    leaf = parts[-2] if parts[-1] in ("weight", "bias", "weight_packed", "weight_scale") else parts[-1]
    if leaf in ("embed_tokens", "lm_head"):
        return -(-cfg.vocab_size // world) / cfg.vocab_size
    if name.endswith(".weight_global_scale") or world == 1:
        return 1.0
    if cfg.hybrid is None and leaf in ("k_proj", "v_proj"):
        kv = cfg.num_key_value_heads
        return 1.0 / world if kv >= world else 1.0 / kv
    return 1.0 / world if leaf in SPLIT_LEAVES else 1.0


def estimate(path: str | Path, *, world: int = 1, dtype: str = "bfloat16", kv_budget_mb: int = 0,
             max_sessions: int = 1, reserve_mb: int = 0) -> RankMemory:
    """Rank 0's bytes for the target at `path` (config.json and safetensors headers only)."""
    path = model_folder(path)
    cfg = ModelConfig.from_dir(path)
    elem = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    files = weight_files(path)
    headers: dict[Path, dict] = {}
    mem = RankMemory(world=world, dtype=str(parse_dtype(dtype)).removeprefix("torch."))
    for name, file in files.items():
        if cfg.hybrid is not None and ignored(cfg, name):
            continue
        if cfg.tie_word_embeddings and name == "lm_head.weight" and cfg.hybrid is None:
            continue
        if file not in headers:
            headers[file] = read_header(file)
        info = headers[file][files.stored(name)]
        numel = 1
        for d in info["shape"]:
            numel *= d
        packed = name.endswith(PACKED_PARTS)
        if packed:
            size = numel * ELEMENT_BYTES[info["dtype"]]
        elif name.endswith(FP32_KEPT) or "conv1d" in name:
            size = numel * 4
        else:
            size = numel * elem
        share = int(size * _share(name, cfg, world))
        if re.search(r"\.experts\.\d+\.", name):
            mem.experts += share
            if name.endswith(".weight_packed"):
                mem.experts_dequantized += int(numel * 2 * elem * _share(name, cfg, world))
            elif not packed:
                mem.experts_dequantized += share
        else:
            mem.trunk += share
    mem.kv = kv_budget_mb * 1024 * 1024
    if cfg.hybrid is not None and cfg.hybrid.kda_layers:
        mem.state = cfg.hybrid.state_bytes_per_session() * max_sessions // world
    mem.reserve = reserve_mb * 1024 * 1024
    return mem


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def plateau(mem: RankMemory, *, device: str | torch.device = "cpu", features_mb: int = 0,
            baseline: int | None = None) -> dict:
    """The memory a rank settles at, stated at start-up as the `memory_plateau` event: the
    preflight's total (weights, the whole KV budget, KDA state slots, the runtime reserve) plus
    the prefix cache's tap-row arena (--prefix-cache-hidden-mb, taken whole when the first rows
    come); on a CPU also the process's resident memory before loading (interpreter, libraries),
    so that `plateau_bytes` is what the process's RSS stays under. The KV pool reaches its budget
    only when that many blocks were held at once (kv_pool.py: touched blocks are reused first)."""
    cpu = torch.device(device).type == "cpu"
    base = (rss_bytes() if baseline is None else baseline) if cpu else 0
    parts = dict(baseline_bytes=base, weights_bytes=mem.experts + mem.trunk, kv_budget_bytes=mem.kv,
                 state_bytes=mem.state, features_bytes=features_mb * 2 ** 20, reserve_bytes=mem.reserve)
    total = sum(parts.values())
    return dict(plateau_bytes=total, plateau_gib=round(total / GIB, 3),
                of="host RSS" if cpu else "device memory per rank", **parts)


def device_memory(device: str | torch.device, world: int = 1) -> tuple[int, str]:
    """(bytes one rank may use, a description): a CUDA device's free memory, or this host's
    available memory shared by the `world` ranks of this node."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, f"{torch.cuda.get_device_name(device)}, {free / GIB:.1f} of {total / GIB:.1f} GiB free"
    avail = _mem_available()
    return avail // world, f"host memory, {avail / GIB:.1f} GiB available" + (
        f" for {world} ranks" if world > 1 else "")


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check(path, *, world: int, dtype: str, device: str, kv_budget_mb: int, max_sessions: int, reserve_mb: int,
          device_memory_gb: float | None = None, local_ranks: int | None = None) -> RankMemory:
    """`estimate`, then PreflightError when a rank would not fit: the numbers, and what to change."""
    mem = estimate(path, world=world, dtype=dtype, kv_budget_mb=kv_budget_mb, max_sessions=max_sessions,
                   reserve_mb=reserve_mb)
    if device_memory_gb is not None:
        mem.device, mem.device_name = int(device_memory_gb * GIB), f"--device-memory-gb {device_memory_gb:g}"
    else:
        mem.device, mem.device_name = device_memory(device, local_ranks or world)
    if not mem.fits:
        over = mem.total - mem.device
        weights, fixed = mem.experts + mem.trunk, mem.kv + mem.state + mem.reserve
        fixes = []
        if mem.kv >= over:
            fixes.append(f"a KV budget of at most {(mem.kv - over) // 2 ** 20} MB (--kv-cache-budget-mb, now "
                         f"{mem.kv // 2 ** 20})")
        if mem.device > fixed:
            fixes.append(f"about {weights * world // (mem.device - fixed) + 1} ranks or more (--tensor-parallel-size, "
                         f"now {world}; the weights are {fmt(weights * world)} in all)")
        if mem.experts and mem.experts_dequantized <= mem.experts:
            fixes.append("an FP4-packed checkpoint of the experts (compressed-tensors mxfp4- or nvfp4-pack-quantized)")
        fixes.append(f"a device with at least {fmt(mem.total)} free per rank")
        raise PreflightError(f"{path}: the target does not fit: {fmt(mem.total)} per rank needed, "
                             f"{fmt(mem.device)} available ({mem.device_name}), {fmt(over)} over.\n{mem.table()}\n"
                             f"To fit: " + "; or ".join(fixes))
    return mem


def main(argv=None) -> int:
    """`splitspec preflight`: print the per-rank table of a target folder for a layout and a device."""
    import argparse
    p = argparse.ArgumentParser(prog="splitspec preflight", description=main.__doc__.splitlines()[0])
    p.add_argument("model_path")
    p.add_argument("--tensor-parallel-size", "--tp-size", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-budget-mb", type=int, default=0)
    p.add_argument("--max-running-requests", type=int, default=1, help="KDA state slots (one per running session)")
    p.add_argument("--memory-reserve-mb", type=int, default=0)
    p.add_argument("--device-memory-gb", type=float, default=None,
                   help="the memory of each rank's device (default: this machine's)")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    try:
        mem = check(a.model_path, world=a.tensor_parallel_size, dtype=a.dtype, device=a.device,
                    kv_budget_mb=a.kv_cache_budget_mb, max_sessions=a.max_running_requests,
                    reserve_mb=a.memory_reserve_mb, device_memory_gb=a.device_memory_gb)
    except PreflightError as exc:
        print(exc)
        return 1
    print(mem.table())
    print(f"fits: {mem.total / GIB:.2f} of {mem.device / GIB:.2f} GiB ({mem.device_name})")
    return 0
