"""Issue 25: does torch.compile (Inductor, C++ on CPU) beat the hand-fused eager forward here?

    python docs/bench/issue25/compile.py

Times the part of each layer between two attentions (o_proj + residual, norm, gate/up, SiLU,
down + residual, norm, q/k/v, q/k norm and rope) over the bundled target's 8 layers, eager (as
the serving forward runs it, fused.py's layouts) and compiled with `dynamic=True` (one graph
for every row count; attention stays outside, as vLLM splits its graphs), at 1 and 8 rows,
one thread, medians of 300 calls, taking turns. Also prints the compile time. The serving
path stays eager unless the compiled one wins by more than the noise.
"""
from __future__ import annotations

import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402

from splitspec.models.fused import fused, transposed  # noqa: E402
from splitspec.models.loader import load_model  # noqa: E402
from splitspec.models.dense import rms_norm, rope_rows  # noqa: E402

torch.set_num_threads(1)
m = load_model(ROOT / "models" / "splitspec-code-target")
cfg = m.cfg
HQ, HKV, D, EPS = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps


def between(x, a, wo, ln2, wgu, wd, ln1, wqkv, qks, rope):
    x = x + a @ wo
    g, u = (rms_norm(x, ln2, EPS) @ wgu).chunk(2, -1)
    x = x + (torch.nn.functional.silu(g) * u) @ wd
    qkv = rms_norm(x, ln1, EPS) @ wqkv
    n = x.shape[0]
    qk = rope_rows(rms_norm(qkv[:, :(HQ + HKV) * D].view(n, HQ + HKV, D), qks, EPS), rope)
    return x, qk, qkv[:, (HQ + HKV) * D:]


def bench(f, n=300):
    for _ in range(20):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


weights = []
for layer in m.model.layers:
    a = layer.self_attn
    qks = torch.cat((a.q_norm.weight.expand(HQ, -1), a.k_norm.weight.expand(HKV, -1)))
    weights.append(dict(wo=transposed(a.o_proj), ln2=layer.post_attention_layernorm.weight,
                        wgu=fused(layer.mlp, ("gate_proj", "up_proj"))[0], wd=transposed(layer.mlp.down_proj),
                        ln1=layer.input_layernorm.weight, wqkv=fused(a, ("q_proj", "k_proj", "v_proj"))[0], qks=qks))
compiled = torch.compile(between, dynamic=True)
print(f"$ python {' '.join(sys.argv)}")
print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
with torch.inference_mode():
    for rows in (1, 8, 1, 8):
        x, att = torch.randn(rows, cfg.hidden_size), torch.randn(rows, HQ * D)
        rope = torch.randn(rows, 2, 1, D)

        def run(f):
            return lambda: [f(x, att, rope=rope, **w) for w in weights]
        t = time.perf_counter()
        run(compiled)()
        c = time.perf_counter() - t
        e, k = bench(run(between)), bench(run(compiled))
        print(f"{rows} row(s): eager {e:.0f} us, compiled {k:.0f} us, compiled / eager {k / e:.2f} "
              f"(first call {c:.1f} s)", flush=True)
