"""A DFlash2 draft through the real services: the draft service loads it (and says so), greedy
speculation equals target-only decoding, and sampled speculation follows the target's
distribution in both draft modes (sampled drafts are verified with the selector's q)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from draft_service.dflash import new_draft, save_draft
from draft_service.dflash2 import new_dflash2
from service_helpers import collect, running_stack
from splitspec_tools.client import build_request
from splitspec.v1 import common_pb2, draft_pb2_grpc
from target_service.engine import generate
from sampling_law import dflash_law


@pytest.fixture(scope="module")
def services(model, target_dir, tmp_path_factory):
    base = new_draft(model.cfg, num_layers=1, block_size=6, mask_token_id=2, seed=5)
    d = new_dflash2(base, selector_rank=8, selector_top_k=4, seed=5)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():     # a selector and convs that do something (init leaves them neutral)
        d.candidate_selector.successor_codebook.normal_(0, 0.5, generator=g)
        for layer in d.layers:
            layer.attention_conv.kernel_projection.weight.normal_(0, 0.05, generator=g)
    draft_dir = tmp_path_factory.mktemp("draft") / "tiny-dflash2"
    save_draft(d, draft_dir)
    logs = tmp_path_factory.mktemp("logs")
    # A generous draft timeout: on a loaded machine a slow Propose would otherwise fall back to
    # target-only steps, which are exact too, so a request that never drafted proves nothing.
    with running_stack(target_dir, logs, draft_dir, "--speculative-algorithm", "DFLASH",
                       "--draft-timeout-ms", "60000") as stack:
        yield stack


def test_draft_service_reports_the_architecture(services):
    with grpc.insecure_channel(services[1].address) as ch:
        info = draft_pb2_grpc.DraftStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)
    assert info.method == "dflash" and info.architecture == "DFlash2DraftModel" and info.block_size == 6


def test_greedy_dflash2_through_the_services_equals_target_only(stub, model):
    prompts = [[5, 6, 7], [9, 9, 9, 9, 9], list(range(20, 40))]

    def run(p):
        return collect(stub.Generate(build_request(p, max_new_tokens=40, ignore_eos=True, method="dflash"),
                                     timeout=300))
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(run, prompts))
    for (ids, _, complete), p in zip(results, prompts):
        assert ids == generate(model, p, 40)
        assert complete.stats.method == "dflash" and complete.stats.draft_fallbacks == 0
        # verify_steps counts target-only Decode steps too; drafted tokens are what says it speculated.
        assert complete.stats.draft_tokens > 0 and any(s.k for s in complete.stats.steps)


@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_dflash2_sampling_follows_the_target_distribution(stub, model, draft_sampling):
    stats = dflash_law(stub, model, 600, draft_sampling=draft_sampling)
    # Every request verified drafts (verify_steps counts target-only Decode steps too).
    drafted = sum(1 for st in stats if st.draft_tokens > 0 and any(s.k for s in st.steps))
    assert drafted == len(stats), drafted
