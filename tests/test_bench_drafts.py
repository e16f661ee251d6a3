"""`splitspec bench-drafts` end to end on a tiny random target with a tiny DFlash and a tiny DFlash2
draft, 2 prompts and a few tokens: both drafts and every setting are reported, the figures are in
range and agree with figures recomputed from the raw request streams, every T=0 output equals
target-only decoding, and the Markdown gives the τ ratio. No timing
thresholds: a benchmark, not a test of speed."""
from __future__ import annotations

import json

import pytest
import torch

from draft_service.dflash import new_draft, save_draft
from draft_service.dflash2 import new_dflash2
from service_helpers import tiny_target_dir
from splitspec_tools.bench import drafts as drafts_bench
from splitspec_tools.bench.drafts import main, markdown
from target_service.engine import generate
from splitspec.models.loader import load_model

B = 6


def test_bench_drafts_end_to_end(tmp_path, monkeypatch):
    target = tiny_target_dir(1024)
    model = load_model(target)
    cfg = model.cfg
    save_draft(new_draft(cfg, num_layers=1, block_size=B, mask_token_id=2, seed=3), tmp_path / "dflash")
    d2 = new_dflash2(new_draft(cfg, num_layers=1, block_size=B, mask_token_id=2, seed=4),
                     selector_rank=8, selector_top_k=4, seed=4)
    with torch.no_grad():      # a selector that does something (the init leaves it neutral)
        d2.candidate_selector.successor_codebook.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    save_draft(d2, tmp_path / "dflash2")
    labels = ["dflash", "dflash2"]
    # Every request the bench sends, with the draft it went to: the figures below are recomputed
    # from these raw streams rather than read back from the report that derived them.
    runs = []

    class Recording(drafts_bench.Gateway):
        made = 0

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.label = labels[Recording.made % len(labels)]      # one runner per draft, in --draft order
            Recording.made += 1

        def run(self, prompt_ids, max_new, params, **kw):
            sample = super().run(prompt_ids, max_new, params, **kw)
            mode = self.draft_sampling if params.temperature > 0 else None
            runs.append(((params.temperature, mode, self.label), list(prompt_ids), max_new, sample))
            return sample
    monkeypatch.setattr(drafts_bench, "Gateway", Recording)
    out = tmp_path / "out"
    argv = ["--draft", str(tmp_path / "dflash"), "--draft", str(tmp_path / "dflash2"), "--target-model-path",
            str(target), "--num-prompts", "2", "--max-new-tokens", "8", "--max-prompt-tokens", "40",
            "--warmup", "0", "--ceiling-paths", "4", "--out", str(out)]
    assert main(argv) == 0
    r = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert [d["architecture"] for d in r["drafts"]] == ["DFlashDraftModel", "DFlash2DraftModel"]
    settings = {(e["temperature"], e["draft_sampling"], e["draft"]) for e in r["results"]}
    assert settings == {(t, m, d) for t, m in ((0.0, None), (1.0, "greedy"), (1.0, "sample")) for d in labels}
    assert {key for key, *_ in runs} == settings and len(runs) == 2 * len(settings)

    # Lossless against the target itself, not only draft against draft: every T=0 stream is
    # target-only greedy decoding of its prompt.
    greedy = [(ids, n, s) for (t, _, _), ids, n, s in runs if t == 0]
    assert len(greedy) == 4
    for ids, n, s in greedy:
        assert s.tokens == generate(model, ids, n)
    assert r["lossless"]["requests"] == 2 and r["lossless"]["mismatches"] == []

    tau = {}          # pooled τ from the streams: tokens after the prefill's one, per verify step
    for key in settings:
        mine = [s for k, _, _, s in runs if k == key]
        assert all(len(s.tokens) == 8 for s in mine)
        tau[key] = sum(len(s.tokens) - 1 for s in mine) / sum(s.verify_steps for s in mine)
    for e in r["results"]:
        key = (e["temperature"], e["draft_sampling"], e["draft"])
        first = (e["temperature"], e["draft_sampling"], labels[0])
        assert e["requests"] == 2 and e["tokens"] == 2 * 8
        assert e["tau"] == pytest.approx(tau[key]) and 1.0 <= e["tau"] <= B
        assert e["tau_vs_first"] == pytest.approx(tau[key] / tau[first])
        assert all(0.0 <= p <= 1.0 for p in e["per_position_acceptance"])
        assert e["draft_forward_ms_p50"] > 0 and e["method_mismatches"] == 0 and e["draft_fallbacks"] == 0
        # At T=0 the target is deterministic, so a perfect drafter's τ is the width exactly.
        assert e["ceiling_tau"] == B if e["temperature"] == 0 else 1.0 <= e["ceiling_tau"] <= B
        assert e["ceiling_share"] == pytest.approx(tau[key] / e["ceiling_tau"])
    assert r["meta"]["command"].startswith("splitspec bench-drafts ") and r["meta"]["git_revision"] in md
    ratio = tau[(0.0, None, "dflash2")] / tau[(0.0, None, "dflash")]
    assert f"| dflash2 (DFlash2) | {tau[(0.0, None, 'dflash2')]:.2f} | {ratio:.2f}x |" in md     # τ, τ ÷ first
    assert "Lossless check: at T=0 all drafts gave the same tokens on 2/2" in md
    r["lossless"]["mismatches"] = ["dflash2 ≠ dflash on p (repeat 1)"]     # how a failure reads
    assert "**LOSSLESS CHECK FAILED at T=0: 1 output(s) differ between drafts:** dflash2 ≠ dflash" in markdown(r)


def test_bench_drafts_by_prompt_length(tmp_path, monkeypatch):
    """--prompt-lengths runs the same prompts at each length, cut to their last L tokens, reports
    τ per length (with the T=0 ceiling) and a by-length table; T=0 streams stay target-only greedy."""
    target = tiny_target_dir(1024)
    model = load_model(target)
    save_draft(new_draft(model.cfg, num_layers=1, block_size=B, mask_token_id=2, seed=5), tmp_path / "dflash")
    sent = []

    class Recording(drafts_bench.Gateway):
        def run(self, prompt_ids, max_new, params, **kw):
            sample = super().run(prompt_ids, max_new, params, **kw)
            sent.append((list(prompt_ids), max_new, sample))
            return sample
    monkeypatch.setattr(drafts_bench, "Gateway", Recording)
    out = tmp_path / "out"
    argv = ["--draft", str(tmp_path / "dflash"), "--target-model-path", str(target), "--num-prompts", "2",
            "--max-new-tokens", "6", "--prompt-lengths", "12,40", "--temperatures", "0", "--warmup", "0",
            "--ceiling-paths", "0", "--out", str(out)]
    assert main(argv) == 0
    r = json.loads((out / "results.json").read_text())
    assert r["run"]["prompt_lengths"] == [12, 40]
    assert [(e["prompt_tokens"], e["ceiling_tau"]) for e in r["results"]] == [(12, B), (40, B)]
    assert [len(ids) for ids, _, _ in sent] == [12, 12, 40, 40]
    for short, long in zip(sent[:2], sent[2:]):
        assert short[0] == long[0][-12:]            # the same prompt, less of what comes before
    for ids, n, s in sent:
        assert s.tokens == generate(model, ids, n)
    md = (out / "results.md").read_text()
    assert "## By prompt length" in md and "τ @12" in md and "ms @40" in md
    with pytest.raises(SystemExit, match="exceed the target's context"):
        main(argv[:-2] + ["--out", str(out), "--prompt-lengths", "5000"])
