"""The memory a target states at start-up (issue 54 item 8): the `memory_plateau` log event (the
preflight's weights, KV budget, state and reserve, the tap-row arena, and on a CPU the process's
resident memory before loading), and a served target with its prefix cache on staying under it
while prompts that share nothing keep coming: the pool reuses touched blocks, cached ones
included, before never-touched ones, so its resident memory does not walk with the traffic."""
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from service_helpers import ROOT, collect, gateway_stub, running_gateway, running_target
from splitspec_tools.client import build_request
from target_service import preflight

CODE_TARGET = ROOT / "models" / "splitspec-code-target"
PROMPT_TOKENS, NEW_TOKENS, STREAMS, ROUNDS, RESERVE_MB = 192, 4, 4, 10, 16

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def logged(log: Path, event: str) -> dict:
    for line in log.read_text().splitlines():
        if line.startswith("{") and json.loads(line).get("event") == event:
            return json.loads(line)
    raise AssertionError(f"no {event} in {log}")


def test_the_plateau_adds_the_preflight_the_arena_and_the_process():
    mem = preflight.RankMemory(world=1, dtype="bfloat16", trunk=100, kv=1000, state=10, reserve=5)
    got = preflight.plateau(mem, device="cpu", features_mb=1, baseline=7)
    assert got["plateau_bytes"] == 7 + 100 + 1000 + 10 + 5 + 2 ** 20 and got["of"] == "host RSS"
    assert preflight.plateau(mem, device="meta", baseline=7)["plateau_bytes"] == mem.total     # a device: no process
    assert preflight.plateau(mem)["baseline_bytes"] == preflight.rss_bytes() > 0


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc")
def test_rss_stays_under_the_stated_plateau_under_unique_prompts(tmp_path):
    """Rounds of prompts that share nothing (every block published, none ever hit again). With
    never-touched blocks handed out first, every round would add its K/V to the resident memory
    (16 x 196 tokens x 4 KiB, 12.8 MB a round here, plus the 256 MiB once mapped ahead for them);
    now, once the cache holds its reserve (16 MiB: two rounds), the later rounds reuse the blocks
    the first ones touched."""
    with running_target(CODE_TARGET, tmp_path, "--torch-threads", "1", "--kv-cache-budget-mb", "1024",
                        "--prefix-cache-reserve-mb", str(RESERVE_MB)) as target, \
            running_gateway(target, tmp_path) as gw:
        plateau = logged(target.log_path, "memory_plateau")
        serving = logged(target.log_path, "serving")
        assert serving["prefix_cache"] and plateau["kv_budget_bytes"] == 1024 * 2 ** 20
        assert plateau["plateau_bytes"] == sum(v for k, v in plateau.items() if k.endswith("_bytes") and k != "plateau_bytes")
        ch, stub = gateway_stub(gw.address)
        pid = target.proc.pid
        prompt = 0

        def one(i: int):
            ids = [3 + (i * 7919 + j * 31) % 8000 for j in range(PROMPT_TOKENS)]    # distinct from the first token on
            out, _, complete = collect(stub.Generate(build_request(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                                    method="none"), timeout=120))
            return len(out), complete.usage.cached_tokens

        samples = []
        with ThreadPoolExecutor(STREAMS) as pool:
            for _ in range(ROUNDS):
                got = list(pool.map(one, range(prompt, prompt + 4 * STREAMS)))
                prompt += 4 * STREAMS
                assert got == [(NEW_TOKENS, 0)] * (4 * STREAMS)
                samples.append(rss(pid))
        ch.close()
    written = (ROUNDS - 3) * 4 * STREAMS * (PROMPT_TOKENS + NEW_TOKENS) * 4096
    assert max(samples) <= plateau["plateau_bytes"], (samples, plateau)
    # What the rounds after the reserve filled added is far less than the K/V they wrote
    # (allocator noise aside).
    assert samples[-1] - samples[2] < written // 4, (samples, written)
