"""Issue 25: hidden-state encode / decode cost, before and after, interleaved, medians.

    python docs/bench/issue25/codec.py [--rows 400,3] [--repeats 200]

"before" is the code of splitspec/wire.py before issue 25, kept here verbatim: encode to a new
Tensor message, then CopyFrom into the response; decode through numpy with a copy. "after" is
the current `tensor_to_pb(..., out=resp.hidden)` / `tensor_from_pb` (a view over the bytes).
Rows: 400 (a prompt's features at Open) and 3 (a step's) of 4 taps x 256 = 1024 features.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from splitspec.v1 import common_pb2, target_pb2  # noqa: E402
from splitspec.wire import tensor_from_pb, tensor_to_pb  # noqa: E402

_TO_PB = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}


def old_to_pb(t, dtype=None):
    t = t.detach().to("cpu", dtype or t.dtype).contiguous()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    data = raw.numpy().astype(raw.numpy().dtype.newbyteorder("<"), copy=False).tobytes()
    return common_pb2.Tensor(data=data, dtype=_TO_PB[t.dtype], shape=list(t.shape))


def old_from_pb(msg):
    dtype = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16}[msg.dtype]
    np_dtype = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "<i2"}[dtype]
    arr = np.frombuffer(msg.data, dtype=np_dtype).reshape(tuple(msg.shape)).copy()
    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="400,3")
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(1)
    for rows in [int(r) for r in a.rows.split(",")]:
        for dtype in (torch.float32, torch.bfloat16):
            t = torch.randn(rows, 1024)
            times = {k: [] for k in ("encode before", "encode after", "decode before", "decode after")}
            for _ in range(a.repeats):
                s = time.perf_counter()
                resp = target_pb2.TargetVerified()
                resp.hidden.CopyFrom(old_to_pb(t, dtype))
                wire = resp.SerializeToString()
                times["encode before"].append(time.perf_counter() - s)
                s = time.perf_counter()
                resp = target_pb2.TargetVerified()
                tensor_to_pb(t, dtype, out=resp.hidden)
                wire2 = resp.SerializeToString()
                times["encode after"].append(time.perf_counter() - s)
                assert wire == wire2
                msg = target_pb2.TargetVerified.FromString(wire)
                s = time.perf_counter()
                x = old_from_pb(msg.hidden)
                times["decode before"].append(time.perf_counter() - s)
                s = time.perf_counter()
                y = tensor_from_pb(msg.hidden)
                times["decode after"].append(time.perf_counter() - s)
                assert torch.equal(x, y)
            print(f"{rows} rows {str(dtype).removeprefix('torch.')} ({len(wire)} B): " + ", ".join(
                f"{k} {statistics.median(v) * 1e6:.0f} us" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
