"""`splitspec bench-drafts` end to end on a tiny random target with a tiny DFlash and a tiny DFlash2
draft, 2 prompts and a few tokens: both drafts and every setting are reported, the figures are in
range, the T=0 outputs agree across drafts, and the Markdown gives the τ ratio. No timing
thresholds: a benchmark, not a test of speed."""
from __future__ import annotations

import json

import torch

from draft_service.dflash import new_draft, save_draft
from draft_service.dflash2 import new_dflash2
from service_helpers import tiny_target_dir
from splitspec.bench.drafts import main, markdown
from target_service.loader import load_model

B = 6


def test_bench_drafts_end_to_end(tmp_path):
    target = tiny_target_dir(1024)
    cfg = load_model(target).cfg
    save_draft(new_draft(cfg, num_layers=1, block_size=B, mask_token_id=2, seed=3), tmp_path / "dflash")
    d2 = new_dflash2(new_draft(cfg, num_layers=1, block_size=B, mask_token_id=2, seed=4),
                     selector_rank=8, selector_top_k=4, seed=4)
    with torch.no_grad():      # a selector that does something (the init leaves it neutral)
        d2.candidate_selector.successor_codebook.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    save_draft(d2, tmp_path / "dflash2")
    out = tmp_path / "out"
    argv = ["--draft", str(tmp_path / "dflash"), "--draft", str(tmp_path / "dflash2"), "--target-model-path",
            str(target), "--num-prompts", "2", "--max-new-tokens", "8", "--max-prompt-tokens", "40",
            "--warmup", "0", "--ceiling-paths", "4", "--out", str(out)]
    assert main(argv) == 0
    r = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert [d["architecture"] for d in r["drafts"]] == ["DFlashDraftModel", "DFlash2DraftModel"]
    settings = {(e["temperature"], e["draft_sampling"], e["draft"]) for e in r["results"]}
    assert settings == {(t, m, d) for t, m in ((0.0, None), (1.0, "greedy"), (1.0, "sample"))
                        for d in ("dflash", "dflash2")}
    for e in r["results"]:
        assert e["requests"] == 2 and e["tokens"] == 2 * 8
        assert 1.0 <= e["tau_pooled"] <= B and 1.0 <= e["tau_mean"] <= B
        assert all(0.0 <= p <= 1.0 for p in e["per_position_acceptance"])
        assert e["draft_forward_ms_p50"] > 0 and e["method_mismatches"] == 0 and e["draft_fallbacks"] == 0
        assert 1.0 <= e["ceiling_tau"] <= B and e["ceiling_share"] == e["tau_pooled"] / e["ceiling_tau"]
        if e["draft"] == "dflash":
            assert e["tau_vs_first"] == 1.0
    assert r["lossless"]["requests"] == 2 and r["lossless"]["mismatches"] == []
    assert r["meta"]["command"].startswith("splitspec bench-drafts ") and r["meta"]["git_revision"] in md
    ratio = next(e for e in r["results"] if e["temperature"] == 0 and e["draft"] == "dflash2")["tau_vs_first"]
    assert f"T=0: dflash2 / dflash τ = {ratio:.2f}x" in md
    assert "Lossless check: at T=0 all drafts gave the same tokens on 2/2" in md
    r["lossless"]["mismatches"] = ["dflash2 ≠ dflash on p (repeat 1)"]     # how a failure reads
    assert "**LOSSLESS CHECK FAILED at T=0: 1 output(s) differ between drafts:** dflash2 ≠ dflash" in markdown(r)
