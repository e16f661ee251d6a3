"""The OpenAI surface clients expect (issue 28), through the real services and the official
`openai` client: the target's log-probs (equal with every speculation method), echo scoring of a
prompt (equal to transformers' log-softmax), n > 1 and batched prompts, penalties and logit_bias
(exact under speculation: greedy equality with an in-process reference, and at T = 1 the exact
joint distribution), --chat-template with chat_template_kwargs, and 400s naming the field."""
from __future__ import annotations

import collections
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from service_helpers import collect, gateway_stub, running_gateway, running_stack
from splitspec_tools.client import build_request
from splitspec.engine.sample import SamplingParams
from splitspec_tools.ops.launch import free_port
from target_service.engine import TargetSequence, forward_sequences
from conftest import chi2_pvalue
from sampling_law import exact_joint

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if shout %}LOUDLY {% endif %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
METHODS = ["none", "dflash", "ngram", "auto"]
PROMPT_IDS = [7, 8, 9, 10, 7, 8, 9, 10, 7, 8]          # repeats: n-gram drafts get accepted
PENALTIES = {"presence_penalty": 1.2, "frequency_penalty": 0.5, "repetition_penalty": 1.3,
             "logit_bias": {"11": 4.0, "12": -3.0}}


TARGET_CONTEXT = 1024


@pytest.fixture(scope="module")
def services(target_dir, draft_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    port = free_port()
    with running_stack(target_dir, logs, draft_dir, "--http-port", str(port), "--chat-template", TEMPLATE,
                       "--max-new-tokens-cap", "512") as stack:
        yield (*stack, port)


@pytest.fixture(scope="module")
def client(services):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{services[3]}/v1", api_key="unused", max_retries=0,
                         timeout=300)


def spec(method: str) -> dict:
    return {"speculative": {"method": method}, "ignore_eos": True}


def top_sets(lps) -> list[set]:
    return [set(d) for d in lps.top_logprobs]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completion_logprobs_equal_every_method(client, stream):
    runs = {}
    for method in METHODS:
        got = client.completions.create(model="", prompt=PROMPT_IDS, max_tokens=40, temperature=0, logprobs=3,
                                        stream=stream, extra_body=spec(method))
        if stream:
            events = [e for e in got if e.choices]
            text = "".join(e.choices[0].text for e in events)
            tokens, values, tops = [], [], []
            for e in events:
                if e.choices[0].logprobs is not None:
                    tokens += e.choices[0].logprobs.tokens
                    values += e.choices[0].logprobs.token_logprobs
                    tops += [set(d) for d in e.choices[0].logprobs.top_logprobs]
        else:
            lps = got.choices[0].logprobs
            text, tokens, values, tops = got.choices[0].text, lps.tokens, lps.token_logprobs, top_sets(lps)
        assert len(tokens) == len(values) == len(tops) == 40
        runs[method] = (text, tokens, values, tops)
    text, tokens, values, tops = runs["none"]
    for method in METHODS[1:]:
        t2, k2, v2, s2 = runs[method]
        assert t2 == text and k2 == tokens and s2 == tops, method
        assert max(abs(a - b) for a, b in zip(values, v2)) < 1e-4, method
    assert all(v <= 0 for v in values) and all(tops)


def test_chat_logprobs_equal_every_method_and_name_the_chosen_token(client):
    messages = [{"role": "user", "content": "abcabcabcabc"}]
    ref = None
    for method in METHODS:
        got = client.chat.completions.create(model="", messages=messages, max_completion_tokens=24, temperature=0,
                                             logprobs=True, top_logprobs=4, extra_body=spec(method))
        content = got.choices[0].logprobs.content
        assert len(content) == 24 and all(len(c.top_logprobs) == 4 for c in content)
        assert "".join(c.token for c in content) == got.choices[0].message.content
        row = (got.choices[0].message.content, [c.token for c in content], [c.logprob for c in content],
               [[t.token for t in c.top_logprobs] for c in content])
        if ref is None:
            ref = row
            continue
        assert row[0] == ref[0] and row[1] == ref[1] and row[3] == ref[3], method
        assert max(abs(a - b) for a, b in zip(row[2], ref[2])) < 1e-4, method
    chunks = list(client.chat.completions.create(model="", messages=messages, max_completion_tokens=24, temperature=0,
                                                 logprobs=True, top_logprobs=4, stream=True, extra_body=spec("auto")))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == ref[1]
    assert max(abs(a.logprob - b) for a, b in zip(streamed, ref[2])) < 1e-4


def test_grpc_stream_carries_the_targets_logprob_per_token(services, model):
    _, _, gw, _ = services
    ch, stub = gateway_stub(gw.address)
    req = build_request(PROMPT_IDS, max_new_tokens=16, temperature=0, ignore_eos=True, method="dflash")
    req.sampling.logprobs = 2
    with ch:
        lps, ids = [], []
        for r in stub.Generate(req, timeout=120):
            if r.HasField("chunk"):
                assert len(r.chunk.logprobs) == len(r.chunk.token_ids)
                lps += r.chunk.logprobs
                ids += r.chunk.token_ids
    with torch.no_grad():
        logits = forward_sequences(model, torch.tensor([PROMPT_IDS + ids])).logits[0].float()
    want = torch.log_softmax(logits[len(PROMPT_IDS) - 1:-1], -1)
    for i, lp in enumerate(lps):
        assert lp.token_id == ids[i] and abs(lp.logprob - float(want[i, ids[i]])) < 1e-4
        assert list(lp.top_token_ids) == want[i].topk(2).indices.tolist()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_echo_scores_the_prompt_like_transformers(client, target_dir, stream):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32)
    prompt = [5, 17, 33, 250, 7, 7, 99, 3]
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    got = client.completions.create(model="", prompt=prompt, max_tokens=0, echo=True, logprobs=2, stream=stream)
    if stream:
        events = [e for e in got if e.choices and e.choices[0].logprobs]
        lps = events[0].choices[0].logprobs
        text = events[0].choices[0].text
    else:
        lps, text = got.choices[0].logprobs, got.choices[0].text
        assert got.usage.completion_tokens == 0 and got.choices[0].finish_reason == "length"
    assert lps.token_logprobs[0] is None and len(lps.token_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        assert abs(lps.token_logprobs[i] - float(want[i - 1, prompt[i]])) < 1e-4
    assert "".join(lps.tokens) == text
    # echo with generation: the prompt's tokens, then the generated ones, one log-prob each.
    got = client.completions.create(model="", prompt=prompt, max_tokens=5, echo=True, logprobs=1, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert len(got.choices[0].logprobs.tokens) == len(prompt) + 5
    # With n > 1 every choice echoes and scores its prompt.
    got = client.completions.create(model="", prompt=prompt, max_tokens=2, echo=True, logprobs=0, n=2,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [len(c.logprobs.tokens) for c in got.choices] == [len(prompt) + 2] * 2
    first, second = (c.logprobs.token_logprobs for c in got.choices)   # batched together or not: fp32 rounding
    assert first[0] is None is second[0] and max(abs(a - b) for a, b in zip(first[1:], second[1:])) < 1e-4


def test_n_and_batched_prompts_are_indexed_like_openai(client):
    # A fixed method: auto's per-step choices follow live timings, so its seeded output may vary.
    fixed = {"ignore_eos": True, "speculative": {"method": "ngram"}}
    prompts = ["def add(a, b):", [5, 6, 7, 8]]
    got = client.completions.create(model="", prompt=prompts, n=3, max_tokens=12, temperature=1.0, seed=11,
                                    extra_body=fixed)
    assert [c.index for c in got.choices] == list(range(6))
    assert got.usage.completion_tokens == 6 * 12
    texts = [c.text for c in got.choices]
    assert len(set(texts[:3])) > 1 and len(set(texts[3:])) > 1      # one seed per choice
    for p, prompt in enumerate(prompts):          # choice 0 of a prompt = that prompt alone, same seed
        alone = client.completions.create(model="", prompt=prompt, max_tokens=12, temperature=1.0, seed=11,
                                          extra_body=fixed)
        assert alone.choices[0].text == texts[3 * p]
    events = list(client.completions.create(model="", prompt=prompts, n=3, max_tokens=12, temperature=1.0, seed=11,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=fixed))
    streamed = collections.defaultdict(str)
    finished = set()
    for e in events:
        for c in e.choices:
            streamed[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert [streamed[i] for i in range(6)] == texts and finished == set(range(6))
    assert events[-1].usage.completion_tokens == 72
    chat = client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == chat.choices[1].message.content


def penalised_reference(model, prompt: list[int], n: int) -> list[int]:
    bias = tuple(sorted((int(k), v) for k, v in PENALTIES["logit_bias"].items()))
    params = SamplingParams(presence_penalty=PENALTIES["presence_penalty"],
                            frequency_penalty=PENALTIES["frequency_penalty"],
                            repetition_penalty=PENALTIES["repetition_penalty"], logit_bias=bias)
    seq = TargetSequence(model, prompt, params)
    out = [seq.prefill().committed[0]]
    while len(out) < n:
        out.append(seq.decode().committed[0])
    return out


def test_penalties_and_logit_bias_greedy_equal_every_method(client, services, model):
    want = penalised_reference(model, PROMPT_IDS, 32)
    plain = client.completions.create(model="", prompt=PROMPT_IDS, max_tokens=32, temperature=0,
                                      extra_body=spec("none"))
    _, _, gw, _ = services
    ch, stub = gateway_stub(gw.address)
    with ch:
        for method in METHODS:
            req = build_request(PROMPT_IDS, max_new_tokens=32, temperature=0, ignore_eos=True, method=method)
            req.sampling.presence_penalty = PENALTIES["presence_penalty"]
            req.sampling.frequency_penalty = PENALTIES["frequency_penalty"]
            req.sampling.repetition_penalty = PENALTIES["repetition_penalty"]
            for k, v in PENALTIES["logit_bias"].items():
                req.sampling.logit_bias[int(k)] = v
            ids, _, complete = collect(stub.Generate(req, timeout=120))
            assert ids == want, method
        got = [client.completions.create(model="", prompt=PROMPT_IDS, max_tokens=32, temperature=0,
                                         stream=stream, extra_body={**spec(m), **PENALTIES})
               for m, stream in (("dflash", False), ("ngram", True))]
    texts = [got[0].choices[0].text, "".join(e.choices[0].text for e in got[1] if e.choices)]
    assert texts[0] == texts[1] != plain.choices[0].text
    # A bias of +100 wins every position, speculation or not; min_tokens holds eos back.
    forced = client.completions.create(model="", prompt=PROMPT_IDS, max_tokens=10, temperature=0,
                                       logit_bias={"65": 100}, extra_body={"speculative": {"method": "ngram"},
                                                                           "min_tokens": 10})
    assert forced.choices[0].text == "A" * 10 or len(set(forced.choices[0].text)) == 1


def test_sampling_with_penalties_follows_the_target_distribution(services, model):
    _, _, gw, _ = services
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    n, samples = 3, 480
    params = SamplingParams(temperature=1.0, top_k=3, presence_penalty=1.5, logit_bias=((9, 1.0), (40, 2.0)))
    joint = exact_joint(model, prompt, params, n)
    ch, stub = gateway_stub(gw.address)

    def run(seed):
        req = build_request(prompt, max_new_tokens=n, ignore_eos=True, temperature=1.0, top_k=3, seed=seed,
                            method=["ngram", "dflash", "auto"][seed % 3])
        req.sampling.presence_penalty = 1.5
        req.sampling.logit_bias[9], req.sampling.logit_bias[40] = 1.0, 2.0
        ids, _, complete = collect(stub.Generate(req, timeout=120))
        return tuple(ids), complete.stats
    with ch, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(samples)))
    counts = collections.Counter(ids for ids, _ in results)
    assert set(counts) <= set(joint)
    assert sum(1 for _, st in results if any(s.k for s in st.steps)) > 0
    keys = sorted(joint)
    total = sum(joint.values())
    assert chi2_pvalue([counts.get(k, 0) for k in keys], [joint[k] / total for k in keys]) > 1e-3


def test_chat_template_flag_and_kwargs(client):
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model="", messages=messages, max_tokens=2, temperature=0)
    loud = client.chat.completions.create(model="", messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"chat_template_kwargs": {"shout": True}})
    assert loud.usage.prompt_tokens > plain.usage.prompt_tokens
    events = list(client.chat.completions.create(model="", messages=messages, max_tokens=2, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"chat_template_kwargs": {"shout": True}}))
    assert events[-1].usage.prompt_tokens == loud.usage.prompt_tokens


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"n": 0}, "n"),
    ({"n": 500}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"prompt": ["ok", 5]}, "prompt[1]"),
    ({"echo": "yes"}, "echo"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[p for _, p in BAD])
def test_out_of_range_values_get_a_400_naming_the_field(client, extra, param):
    body = {"prompt": "x", "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="", **{k: body.pop(k) for k in ("prompt",)}, extra_body=body)
    assert err.value.body["param"] == param, err.value.body
    assert param.split("[")[0] in err.value.message
    with pytest.raises(openai.BadRequestError) as err:          # a stream is refused before it starts
        client.completions.create(model="", prompt="x", stream=True, extra_body={"max_tokens": 4, **extra})
    assert err.value.body["param"] == param


def test_chat_errors_and_unknown_fields(client, services):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=messages, top_logprobs=3, max_tokens=2)
    assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=messages, logprobs=True, top_logprobs=30, max_tokens=2)
    assert err.value.body["param"] == "top_logprobs"
    # Unknown fields are ignored (and logged), as vLLM does.
    ok = client.chat.completions.create(model="", messages=messages, max_tokens=2, extra_body={"no_such_field": 1})
    assert ok.choices[0].message.content is not None
    logged = [json.loads(line) for line in services[2].log_path.read_text().splitlines() if "http_unknown_fields" in line]
    assert any(e["fields"] == ["no_such_field"] for e in logged)


def test_bad_formats_are_refused_not_ignored(client):
    """An unknown or malformed response_format (and a malformed structured_outputs) would
    silently get free text: refused with a 400 naming the field, on chat and completions; type
    text is what every answer is, and passes. (Constrained answers: tests/test_structured_*.py.)"""
    messages = [{"role": "user", "content": "hi"}]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    for fmt in (bad_schema, {"type": "yaml"}, "json"):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="", messages=messages, max_tokens=2, response_format=fmt)
        assert err.value.body["param"] == "response_format"
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="", prompt="hi", max_tokens=2, extra_body={"response_format": fmt})
        assert err.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="", messages=messages, max_tokens=2,
                                       extra_body={"structured_outputs": {"choice": ["a", "b"], "regex": "a"}})
    assert err.value.body["param"] == "structured_outputs"
    ok = client.chat.completions.create(model="", messages=messages, max_tokens=2, response_format={"type": "text"})
    assert ok.choices[0].message.content is not None


def test_choice_seeds_and_token_bytes(target_dir):
    from tokenizers import Tokenizer

    from gateway.openai_logprobs import TokenText, _byte_alphabet
    from gateway.openai_mapping import choice_seed
    seeds = [choice_seed(7, i) for i in range(64)]
    assert seeds[0] == 7 and len(set(seeds)) == 64 and all(0 <= x < 2 ** 63 for x in seeds)
    assert choice_seed(7, 1) != choice_seed(8, 0) and choice_seed(7, 1) == choice_seed(7, 1)
    assert sorted(_byte_alphabet().values()) == list(range(256))
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    text = TokenText(tok)
    ids = tok.encode("héllo wörld\n\tdef", add_special_tokens=False).ids
    assert b"".join(bytes(text(i)[1]) for i in ids).decode() == "héllo wörld\n\tdef"


def test_one_failing_choice_keeps_the_others(services, tmp_path):
    target = services[0]
    port = free_port()
    with running_gateway(target, tmp_path, "--http-port", str(port), "--max-sessions", "2"):
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        got = c.completions.create(model="", prompt=[5, 6, 7], n=3, max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
        reasons = [ch.finish_reason for ch in got.choices]
        assert reasons.count("length") == 2 and reasons.count("error") == 1
        failed = next(ch for ch in got.choices if ch.finish_reason == "error")
        assert failed.model_extra["error"]["code"] == "resource_exhausted"
        assert got.usage.completion_tokens == 12
        body = json.dumps({"prompt": [5, 6, 7], "n": 3, "max_tokens": 4, "stream": True, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            lines = [json.loads(x[6:]) for x in resp.read().decode().splitlines() if x.startswith("data: {")]
        assert sum(1 for e in lines if "error" in e) == 1
        assert sum(1 for e in lines for ch in e.get("choices", []) if ch.get("finish_reason") == "length") == 2
