// The splitspec page: one streamed request at a time through the gateway's own OpenAI API, with
// stream_options.token_sources on, so that every chunk says which drafter proposed each token
// (gateway/openai_stream.py). Plain script, no modules or libraries: nothing is fetched but
// this page's three files and the API it calls.
"use strict";

const $ = (id) => document.getElementById(id);
let running = null;          // the AbortController of the request in flight

const SOURCES = ["dflash", "ngram", "target"];

function reset() {
  $("answer").textContent = "";
  for (const s of SOURCES) $("n-" + s).textContent = "0";
  for (const id of ["tau", "tps", "steps"]) $(id).textContent = "–";
  for (const part of ["propose", "verify", "wire"]) $("ms-" + part).textContent = "–";
  for (const i of $("bar").children) i.style.width = "0";
  $("status").textContent = "";
  $("status").classList.remove("error");
}

function say(text, isError) {
  $("status").textContent = text;
  $("status").classList.toggle("error", !!isError);
}

function body() {
  const prompt = $("prompt").value;
  const out = {
    stream: true,
    stream_options: { include_usage: true, token_sources: true },
    max_tokens: parseInt($("max-tokens").value, 10) || 128,
    temperature: parseFloat($("temperature").value) || 0,
  };
  // Without a method the gateway's own default (--speculative-method) runs.
  if ($("method").value) out.speculative = { method: $("method").value };
  if ($("mode").value === "chat") out.messages = [{ role: "user", content: prompt }];
  else out.prompt = prompt;
  return out;
}

// One piece of text marked with its source; "" (no token of its own) stays unmarked.
function addPiece(source, text) {
  if (!text && !source) return;
  const span = document.createElement("span");
  span.textContent = text;
  if (source) {
    span.className = "tok src-" + source;
    span.dataset.source = source;
    span.title = source === "target" ? "the target's own token" : source + " draft, accepted";
    const n = $("n-" + source);
    if (n) n.textContent = String(parseInt(n.textContent, 10) + 1);
  }
  $("answer").appendChild(span);
}

const fmt = (x) => (x < 10 ? x.toFixed(2) : x.toFixed(1));

function showProgress(p, tokens, firstAt) {
  const steps = p.verify_steps || 0;
  $("steps").textContent = String(steps);
  if (steps) $("tau").textContent = (p.committed / steps).toFixed(2);
  const since = (performance.now() - firstAt) / 1000;
  // After the first token: the rate of generation, not of the prompt's prefill.
  if (tokens > 1 && since > 0) $("tps").textContent = fmt((tokens - 1) / since);
  if (!steps) return;
  const propose = p.draft_ms / steps, verify = p.verify_ms / steps, wire = p.wire_ms / steps;
  $("ms-propose").textContent = fmt(propose);
  $("ms-verify").textContent = fmt(verify);
  $("ms-wire").textContent = fmt(wire);
  // The wire time is inside both round trips: shown once, taken from each in proportion.
  const total = propose + verify;
  if (total <= 0) return;
  const [bp, bv, bw] = $("bar").children;
  bp.style.width = (100 * propose * (1 - wire / total) / total) + "%";
  bv.style.width = (100 * verify * (1 - wire / total) / total) + "%";
  bw.style.width = (100 * wire / total) + "%";
}

async function errorText(resp) {
  try {
    const e = await resp.json();
    return `${resp.status}: ${(e.error && e.error.message) || JSON.stringify(e)}`;
  } catch (_) {
    return `${resp.status} ${resp.statusText}`;
  }
}

async function generate(ev) {
  ev.preventDefault();
  if (running) return;
  reset();
  const headers = { "content-type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.authorization = "Bearer " + key;
  const path = $("mode").value === "chat" ? "/v1/chat/completions" : "/v1/completions";
  running = new AbortController();
  $("go").disabled = true;
  $("stop").disabled = false;
  say("waiting…");
  const started = performance.now();
  let firstAt = 0, tokens = 0;
  try {
    const resp = await fetch(path, { method: "POST", headers, body: JSON.stringify(body()), signal: running.signal });
    if (!resp.ok) {
      say(await errorText(resp), true);
      return;
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const raw = buf.slice(0, end);
        buf = buf.slice(end + 2);
        if (!raw.startsWith("data: ")) continue;
        const data = raw.slice(6);
        if (data === "[DONE]") continue;
        const event = JSON.parse(data);
        if (event.error) {
          say(event.error.message || "error", true);
          continue;
        }
        if (event.model) $("model").textContent = event.model;
        const choice = (event.choices || [])[0];
        if (!choice) continue;
        const ext = choice.splitspec;
        if (ext) {
          if (!firstAt) firstAt = performance.now();
          for (const [source, text] of ext.pieces) {
            addPiece(source, text);
            if (source) tokens += 1;
          }
          showProgress(ext.progress, tokens, firstAt);
          say(`streaming… ${tokens} tokens, first after ${Math.round(firstAt - started)} ms`);
        } else {
          addPiece("", (choice.delta && choice.delta.content) || choice.text || "");
        }
        if (choice.finish_reason) {
          const s = event.speculative_stats || {};
          say(`done: ${choice.finish_reason}, ${tokens} tokens, method ran: ${s.method || "?"}, ` +
              `${Math.round(performance.now() - started)} ms`);
        }
      }
    }
  } catch (err) {
    say(err.name === "AbortError" ? "stopped" : String(err), err.name !== "AbortError");
  } finally {
    running = null;
    $("go").disabled = false;
    $("stop").disabled = true;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("ask").addEventListener("submit", generate);
  $("stop").addEventListener("click", () => running && running.abort());
});
