"""Incremental detokenization that never emits a broken character.

Decoding token by token is wrong for byte-level BPE (a character's bytes may span tokens)
and for tokenizers that drop a leading space at the start of a decode. So, as vLLM and TGI
do, each step decodes a small window twice: from `prefix_offset` up to the last emitted token,
and up to the newest token; the delta is the difference. Text ending in U+FFFD (an incomplete
UTF-8 sequence so far) is held back until the next tokens complete it."""
from __future__ import annotations

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 5     # prompt tokens decoded with the first new ones, for word-boundary context


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids=(), *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)[-PROMPT_CONTEXT:]
        if self.ids and self._decode(self.ids).endswith(REPLACEMENT):
            # The prompt ends inside a character: the generation's first bytes finish it. Start
            # the window at the generation, so the stream is exactly the generation's decode.
            self.ids = []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids) -> str:
        """Append tokens; return the text that is now certain (possibly empty)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """At the end of generation: whatever is held back, even an incomplete character
        (it then decodes to U+FFFD, exactly as decoding the whole sequence would)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""
