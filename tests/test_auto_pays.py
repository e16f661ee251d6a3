"""`auto` pays nothing for drafting where drafting cannot pay (issue 42, item 1): a request
whose policy expects no DFlash session to pay back its Open over the request's tokens opens no
draft session, sends no features and verifies no DFlash probe, and still equals target-only
greedy; the expected-pay arithmetic against hand-computed cases.

The gateway runs in process (so the test can set the prices it has measured) against a real tiny
target and DFlash draft."""
from __future__ import annotations

import grpc
import pytest

from draft_service.dflash import new_draft, save_draft
from gateway.policy import REOPEN_EVERY, AutoPolicy, Measurements
from service_helpers import collect, fixed_prices, inproc_gateway, running_draft, running_target
from splitspec_tools.client import build_request
from splitspec.v1 import gateway_pb2_grpc
from target_service.engine import generate

N_NEW = 24
PROMPTS = [[5, 9, 3, 12, 7, 5, 9, 3], [4, 4, 8, 15, 6, 8], [3, 11, 13, 17, 3, 11]]

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def priced(*, draft_open_ms: float, verify_ms: float = 4.0, decode_ms: float = 4.0, accept: float = 0.8):
    """Measurements as if the gateway had seen these prices: a decode forward `decode_ms`, a
    verify's extra width costing (verify_ms - decode_ms) / 7 per token, a DFlash Open."""
    return fixed_prices(decode_ms=decode_ms, verify_ms=verify_ms, draft_open_ms=draft_open_ms,
                        accept={("dflash", "greedy"): accept})


def test_a_session_pays_when_its_savings_over_the_request_beat_the_open():
    # A decode costs 4 ms and so does a width-8 verify (a GPU's prices); 6 of 7 drafts accepted:
    # the best step, k = 7, commits ~7 tokens for 1 + 4 ms, saving ~3.3 ms a token: 63 more
    # tokens save ~200 ms (> a 50 ms Open), 7 more ~23 ms (< 50 ms).
    cheap = AutoPolicy(priced(draft_open_ms=50.0), max_k=7)
    assert cheap.session_pays(64) and not cheap.session_pays(8)
    # A verify as dear as eight decodes: DFlash saves nothing, whatever the length.
    dear = AutoPolicy(priced(draft_open_ms=0.0, verify_ms=32.0), max_k=7)
    assert not dear.session_pays(10_000)
    # Nothing accepted: drafting only costs.
    never = AutoPolicy(priced(draft_open_ms=0.0, accept=0.0), max_k=7)
    assert not never.session_pays(10_000)
    # Skipped sessions are reopened now and then, to re-measure the bucket's acceptance.
    m = priced(draft_open_ms=1e9)
    opens = [AutoPolicy(m, max_k=7).wants_draft(64) for _ in range(3 * REOPEN_EVERY)]
    assert [i for i, o in enumerate(opens) if o] == [REOPEN_EVERY - 1, 3 * REOPEN_EVERY - 1]


@pytest.fixture(scope="module")
def services(target_dir, model, tmp_path_factory):
    draft_dir = tmp_path_factory.mktemp("draft") / "tiny-dflash"
    save_draft(new_draft(model.cfg, num_layers=1, block_size=4, mask_token_id=2, seed=5), draft_dir)
    logs_dir = tmp_path_factory.mktemp("logs")
    with running_target(target_dir, logs_dir, "--torch-threads", "1") as target, \
            running_draft(target_dir, logs_dir, "--torch-threads", "1", draft_dir=draft_dir) as draft:
        yield target.address, draft.address


def run_requests(services, measurements: Measurements | None) -> tuple[list, int]:
    """Greedy auto requests through an in-process gateway; (results, draft sessions opened)."""
    opened = [0]

    def count_opens(backends):
        session = backends.draft.session

        def counting(*a, **kw):
            opened[0] += 1
            return session(*a, **kw)
        backends.draft.session = counting
    with inproc_gateway(*services, measurements=measurements, on_backends=count_opens) as address:
        with grpc.insecure_channel(address) as ch:
            stub = gateway_pb2_grpc.GenerationStub(ch)
            results = [collect(stub.Generate(build_request(p, max_new_tokens=N_NEW, ignore_eos=True, method="auto"),
                                             timeout=120)) for p in PROMPTS]
    return results, opened[0]


def test_a_request_whose_session_cannot_pay_opens_none_and_sends_no_features(services, model):
    # The gateway has measured a DFlash Open far dearer than anything 24 tokens could save.
    results, opened = run_requests(services, priced(draft_open_ms=1e9))
    assert opened == 0
    for p, (ids, _, complete) in zip(PROMPTS, results):
        assert ids == generate(model, p, N_NEW)
        st = complete.stats
        assert st.hidden_state_bytes == 0                          # no features on the wire
        assert all(s.method != "dflash" for s in st.steps)          # no DFlash probe verified
    # Unmeasured, a DFlash session is expected to pay (acceptance starts optimistic): it is tried.
    results, opened = run_requests(services, None)
    assert opened >= 1
    for p, (ids, _, _) in zip(PROMPTS, results):
        assert ids == generate(model, p, N_NEW)


def test_a_re_measuring_session_opens_beside_the_target_and_probes_dflash_in_the_shadow(services, model):
    # DFlash is measured as not worth a session here (its Open dearer than 24 tokens could save,
    # and none of its drafts accepted), so requests skip it; the bucket is due a re-measuring
    # session at once. That session opens while the target decodes, and DFlash's due probe runs
    # in the shadow: proposals scored against the target's own tokens, none verified.
    m = priced(draft_open_ms=1e9, accept=0.0)
    m.reopen_gap["greedy"] = 1
    m.last_tried["dflash"] = -10_000          # a DFlash probe is due at the first decision it can run
    before = sum(m.acceptance(("dflash", "greedy")).trials[0])
    results, opened = run_requests(services, m)
    assert opened >= 1
    for p, (ids, _, complete) in zip(PROMPTS, results):
        assert ids == generate(model, p, N_NEW)
        assert all(s.method != "dflash" for s in complete.stats.steps)   # no DFlash verify
    # The shadow proposals were scored: DFlash's acceptance gained trials (decayed counts shrink
    # by 3 % an update, so any growth is new trials), and a Propose's time was measured.
    assert sum(m.acceptance(("dflash", "greedy")).trials[0]) > 0.97 * before + 0.5
    assert m.draft_ms["dflash"].value != 1.0
