"""Issue 25: CPU time of one batched draft forward (`propose_batch`) for 1 and for 8 sessions,
in process, one intra-op thread, ~400-token contexts, 3 newly committed tokens per session.

    python docs/bench/issue25/propose.py [ROOT]      # ROOT: the checkout to import (default: this one)

Thread CPU time (`time.thread_time`), not wall time: on a shared machine it is what the forward
itself costs, whoever else runs. Median of 25 calls after 5 warm-up calls, twice.
"""
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402

from draft_service.architectures import load_draft  # noqa: E402
from draft_service.dflash import new_pool  # noqa: E402
from draft_service.proposer import DFlashProposer, propose_batch  # noqa: E402

MODELS = Path(__file__).resolve().parents[3] / "models"
torch.set_num_threads(1)
m = load_draft(MODELS / "splitspec-code-draft", MODELS / "splitspec-code-target")
F = m.cfg.target_feature_size
pool = new_pool(m, 9 * 260)
g = torch.Generator().manual_seed(0)


def make(n, length=400):
    ps = []
    for _ in range(n):
        p = DFlashProposer(m, max_len=4000, pool=pool)
        p.open(torch.randint(2, 8000, (length,), generator=g).tolist(), torch.randn(length, F, generator=g))
        ps.append(p)
    return ps


def run(ps, reps=30):
    times = []
    for _ in range(reps):
        items = [(p, len(p.tokens) + 3, [5, 6, 7], torch.randn(len(p.tokens) + 2 - p.cache.length, F)) for p in ps]
        t = time.thread_time()
        out = propose_batch(m, items)
        times.append((time.thread_time() - t) * 1e3)
        assert not any(isinstance(o, Exception) for o in out), out
    return statistics.median(times[5:])


one, eight = make(1), make(8)
for _ in range(2):
    a, b = run(one), run(eight)
    print(f"CPU time per propose_batch: 1 session {a:.2f} ms   8 sessions {b:.2f} ms   ratio {b / a:.2f}", flush=True)
