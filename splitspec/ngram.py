"""Prompt lookup (vLLM's `ngram`, transformers' `prompt_lookup_num_tokens`): the continuation of
the most recent earlier occurrence of the sequence's last n tokens, longest n first.

`NgramIndex` keeps, per n, the latest start of every n-gram that is followed by at least one
token, updated as tokens arrive: a lookup costs O(max_n) instead of a scan of the history,
which matters when the gateway asks before every step of every request."""
from __future__ import annotations


class NgramIndex:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: list[int]) -> None:
        toks = self.tokens
        for tok in new:
            j = len(toks)          # `tok` now follows the n-grams that end at j - 1
            for n in range(self.min_n, min(self.max_n, j) + 1):
                self._last[n][tuple(toks[j - n:j])] = j - n
            toks.append(tok)

    def match(self, k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the latest earlier occurrence of the longest matching
        suffix, that suffix's length n); ([], 0) when nothing matches."""
        toks, L = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            start = self._last[n].get(tuple(toks[L - n:]))
            if start is not None:
                return toks[start + n:start + n + k], n
        return [], 0


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """One-off lookup over a whole history (the index built and thrown away)."""
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index.match(k)[0]
