"""The gateway's page (gateway/web/, issue 55 item 3) against a live stack: the tiny target with
the n-gram draft service, an API key set. The stream's `token_sources` extension is checked over
plain HTTP (its pieces are the answer's text, each token's source named, OpenAI's shape unchanged
without it); then a real headless Chromium, driven by selenium, types a prompt into the page and
the answer streams with its tokens marked by source, and no console errors. Skipped where Debian's
chromium and chromium-driver are not installed (.ci/run installs them)."""
from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import pytest

from service_helpers import running_stack
from splitspec_tools.ops.launch import free_port

KEY = "page-test-key"
# Repeats: the n-gram drafter finds the continuation in the prompt, so the target accepts some.
PROMPT = "one two three four " * 8
REQUEST = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "speculative": {"method": "ngram"}}


@pytest.fixture(scope="module")
def url(target_dir, tmp_path_factory):
    port = free_port()
    with running_stack(target_dir, tmp_path_factory.mktemp("logs"), None, "--http-port", str(port),
                       "--api-key", KEY):
        yield f"http://127.0.0.1:{port}"


def test_a_steps_sources_and_a_chunks_pieces():
    from gateway.generation import step_sources
    from gateway.openai_stream import token_sources
    from splitspec.v1 import gateway_pb2 as pb

    # a verify that accepted 2 of its drafter's tokens, then the bonus; a target-only decode
    assert step_sources("dflash", 2, 3) == [pb.TOKEN_SOURCE_DFLASH] * 2 + [pb.TOKEN_SOURCE_TARGET]
    assert step_sources("none", 0, 1) == [pb.TOKEN_SOURCE_TARGET]
    chunk = pb.Chunk(token_ids=[5, 6, 7], text="héllo!", text_lengths=[2, 0, 3],
                     sources=[pb.TOKEN_SOURCE_NGRAM, pb.TOKEN_SOURCE_DFLASH, pb.TOKEN_SOURCE_TARGET])
    # the second token's bytes were held back (its text came with the third); "!" has no token
    assert token_sources(chunk)["pieces"] == [["ngram", "hé"], ["dflash", ""], ["target", "llo"], ["", "!"]]


def post_stream(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        raw = resp.read().decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_the_stream_names_each_tokens_source(url):
    events = post_stream(url, {**REQUEST, "stream_options": {"token_sources": True, "include_usage": True}})
    chunks = [e["choices"][0] for e in events if e["choices"] and "splitspec" in e["choices"][0]]
    pieces = [p for c in chunks for p in c["splitspec"]["pieces"]]
    assert "".join(t for _, t in pieces) == "".join(c["text"] for c in chunks)
    sources = [s for s, _ in pieces if s]
    assert set(sources) <= {"target", "ngram"} and "ngram" in sources and "target" in sources
    assert len(sources) == events[-1]["usage"]["completion_tokens"]
    # Running totals only grow; the last one is the request's own: tau as the final stats say.
    progress = [c["splitspec"]["progress"] for c in chunks]
    steps = [p["verify_steps"] for p in progress]
    assert steps == sorted(steps) and steps[-1] > 0
    final = next(e["speculative_stats"] for e in events if "speculative_stats" in e)
    assert progress[-1]["verify_steps"] == final["verify_steps"]
    assert progress[-1]["committed"] / steps[-1] == pytest.approx(final["accept_length"], abs=1e-3)
    # Not asked for: the chunks are OpenAI's alone.
    plain = post_stream(url, REQUEST)
    assert not any("splitspec" in c for e in plain for c in e["choices"])


def test_the_page_is_served_without_the_key(url):
    with urllib.request.urlopen(url + "/", timeout=30) as resp:      # redirected to /ui
        assert resp.url.endswith("/ui") and b'id="prompt"' in resp.read()
        assert "default-src 'none'" in resp.headers["content-security-policy"]
    for name in ("app.js", "style.css"):
        with urllib.request.urlopen(f"{url}/ui/{name}", timeout=30) as resp:
            assert resp.status == 200
    with pytest.raises(urllib.error.HTTPError) as err:      # the API itself still wants it
        urllib.request.urlopen(url + "/v1/models", timeout=30)
    assert err.value.code == 401


def chromium_driver(tmp_path):
    """Headless Chromium under chromedriver, or a skip saying what is missing."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (apt-get install -y chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1100,900", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=driver))


def test_the_page_streams_tokens_marked_by_source(url, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser = chromium_driver(tmp_path)
    try:
        browser.get(url + "/ui")
        browser.find_element(By.ID, "api-key").send_keys(KEY)
        Select(browser.find_element(By.ID, "method")).select_by_value("ngram")
        for field, value in (("temperature", "0"), ("max-tokens", "48")):
            box = browser.find_element(By.ID, field)
            box.clear()
            box.send_keys(value)
        browser.find_element(By.ID, "prompt").send_keys(PROMPT)
        browser.find_element(By.ID, "go").click()
        status = browser.find_element(By.ID, "status")
        WebDriverWait(browser, 120).until(lambda _: status.text.startswith("done") or "error" in status.get_attribute("class"))
        assert status.text.startswith("done"), status.text
        marked = browser.find_elements(By.CSS_SELECTOR, "#answer span[data-source]")
        sources = [s.get_attribute("data-source") for s in marked]
        assert "ngram" in sources and "target" in sources and set(sources) <= {"ngram", "target"}
        assert int(browser.find_element(By.ID, "n-ngram").text) == sources.count("ngram")
        assert float(browser.find_element(By.ID, "tau").text) > 1      # accepted drafts: more than a token a step
        assert "Propose" in browser.find_element(By.ID, "split").text
        # The same greedy answer the API gives (speculation is lossless).
        events = post_stream(url, REQUEST)
        text = "".join(c["text"] for e in events for c in e["choices"])
        assert browser.execute_script("return document.getElementById('answer').textContent") == text
        browser.save_screenshot(str(tmp_path / "page.png"))
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        browser.quit()
