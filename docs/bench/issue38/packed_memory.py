"""Resident memory and CPU decode speed of a MoE target whose routed experts are stored
FP4-packed, against its dequantized twin (the same values stored as float32), each loaded in a
fresh process: RSS after loading (VmRSS), the peak during loading (ru_maxrss), and target-only
greedy decode tokens/s, interleaved, medians of --rounds.

    python docs/bench/issue38/packed_memory.py --out runs/fp4-mem --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))

CHILD = r"""
import json, resource, sys, time, torch
torch.set_num_threads(1)
from target_service.engine import load_model, generate
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
def rss():
    return status("VmRSS")
base = rss()
t = time.perf_counter()
m = load_model(sys.argv[1])
load_s = time.perf_counter() - t
after = rss()
peak = status("VmHWM")      # this process's own high-water mark (ru_maxrss carries the parent's over exec)
params = sum(p.numel() * p.element_size() for p in m.parameters())
experts = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if ".experts." in n)
prompt = list(range(10, 42))
generate(m, prompt, 4)
t = time.perf_counter()
out = generate(m, prompt, {new})
tok_s = len(out) / (time.perf_counter() - t)
print(json.dumps(dict(rss_before=base, rss_after=after, peak=peak, param_bytes=params, expert_bytes=experts,
                      load_s=load_s, tok_s=tok_s,
                      tokens=out)))
"""


def child(folder: Path, new: int) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD.format(new=new), str(folder)], capture_output=True, text=True,
                       cwd=ROOT, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--format", default="mxfp4-pack-quantized")
    a = p.parse_args()
    from fp4_models import save_packed_twin
    from hybrid_models import save_tiny_deepseek
    out = Path(a.out)
    src = out / "src"
    if not (src / "model.safetensors").is_file():
        # DeepSeek-V3 layout: 5 MoE layers x 32 experts of 3 x 512 x 512: 503 MB of float32 experts
        save_tiny_deepseek(src, vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_rope_head_dim=16,
                           qk_nope_head_dim=32, v_head_dim=32, num_hidden_layers=6, n_routed_experts=32,
                           n_group=4, topk_group=2, num_experts_per_tok=4)
    packed, twin = out / "packed", out / "twin"
    if not (packed / "model.safetensors").is_file():
        save_packed_twin(src, packed, twin, a.format)
    print("command:", " ".join(sys.argv), "| machine:", platform.processor() or platform.machine(),
          f"{os.cpu_count()} cores", flush=True)
    res = {"packed": [], "twin": []}
    for r in range(a.rounds):
        for name, folder in (("packed", packed), ("twin", twin)):
            res[name].append(child(folder, a.new_tokens))
            x = res[name][-1]
            print(r, name, {k: v for k, v in x.items() if k != "tokens"}, flush=True)
    assert all(x["tokens"] == res["twin"][0]["tokens"] for x in res["packed"] + res["twin"]), "outputs differ"
    med = {n: {k: statistics.median(x[k] for x in v) for k in ("rss_after", "peak", "param_bytes", "expert_bytes", "tok_s", "load_s")}
           for n, v in res.items()}
    mb = 1024 * 1024
    expert_fp32 = med["twin"]["expert_bytes"]
    saved = med["twin"]["rss_after"] - med["packed"]["rss_after"]
    print(f"routed experts: {expert_fp32 / mb:.0f} MB as float32 (twin), {med['packed']['expert_bytes'] / mb:.1f} MB "
          f"packed; all parameters: twin {med['twin']['param_bytes'] / mb:.0f} MB, packed "
          f"{med['packed']['param_bytes'] / mb:.0f} MB")
    print(f"RSS after load: packed {med['packed']['rss_after'] / mb:.0f} MB, twin {med['twin']['rss_after'] / mb:.0f} MB: "
          f"packed is {saved / mb:.0f} MB lower = {saved / expert_fp32:.0%} of the float32 expert bytes")
    print(f"peak RSS while loading: packed {med['packed']['peak'] / mb:.0f} MB, twin {med['twin']['peak'] / mb:.0f} MB")
    print(f"greedy decode tok/s (1 thread): packed {med['packed']['tok_s']:.1f}, twin {med['twin']['tok_s']:.1f}, "
          f"packed/twin {med['packed']['tok_s'] / med['twin']['tok_s']:.2f}x; identical tokens")


if __name__ == "__main__":
    main()
