"""Log-probs in OpenAI's two shapes (chat's `content` list and completions' legacy columns),
with each token's text and bytes recovered from the tokenizer (byte-level BPE decoded by hand,
so a token that is half a UTF-8 character still has its exact bytes)."""
from __future__ import annotations

MIN_LOGPROB = -9999.0      # what -inf becomes in JSON (vLLM's choice): JSON has no infinity


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE spells each byte as one printable character: the printable Latin-1 bytes as
    themselves, the others shifted past 255 in order. Inverting that recovers a token's bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in keep]
    table = {chr(b): b for b in keep}
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


class TokenText:
    """Token id -> (text, bytes) for log-probs, cached per id."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.bytes_level = "ByteLevel" in type(tokenizer.decoder).__name__ or "ByteLevel" in str(tokenizer.decoder)
        self.alphabet = _byte_alphabet()
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is None:
            piece = self.tok.id_to_token(token_id) or ""
            if self.bytes_level and all(c in self.alphabet for c in piece):
                raw = bytes(self.alphabet[c] for c in piece)
            else:
                raw = self.tok.decode([token_id], skip_special_tokens=False).encode()
            hit = self.cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit


def _lp(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


def chat_logprobs(text: TokenText, lps, top_n: int) -> list[dict]:
    out = []
    for lp in lps:
        s, b = text(lp.token_id)
        out.append({"token": s, "logprob": _lp(lp.logprob), "bytes": b, "top_logprobs": [
            {"token": text(t)[0], "logprob": _lp(v), "bytes": text(t)[1]}
            for t, v in list(zip(lp.top_token_ids, lp.top_logprobs))[:top_n]]})
    return out


def completion_logprobs(text: TokenText, lps, offset: int, *, prompt_ids=(), prompt_lps=()) -> dict:
    """The legacy completions shape. With echo (prompt_ids given) the prompt's tokens come first
    (the first has no log-prob: nothing predicts it); each top_logprobs entry holds the top-N
    and the chosen token."""
    tokens, values, tops, offsets = [], [], [], []
    entries = []
    if len(prompt_ids):
        entries.append((prompt_ids[0], None))
        entries += [(lp.token_id, lp) for lp in prompt_lps]
    entries += [(lp.token_id, lp) for lp in lps]
    for token_id, lp in entries:
        s = text(token_id)[0]
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_lp(lp.logprob))
        top = {text(t)[0]: _lp(v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
        top.setdefault(s, _lp(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
