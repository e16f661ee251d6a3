"""Prompt lookup (vLLM's `ngram`, transformers' `prompt_lookup_num_tokens`): the continuation of
the most recent earlier occurrence of the sequence's last n tokens, longest n first.

`NgramIndex` keeps the history in a numpy array and finds the occurrences with a few vectorised
comparisons per lookup (one per n, each narrowing the last one's matches), so a lookup costs tens
of microseconds however long the history, and adding the prompt costs a copy. (A dict of every
n-gram's starts, as first built, made lookups O(1) but cost the gateway ~4 ms of Python per
2,000-token prompt: 10 % of its CPU at 8 streams of long prompts, on cores the target shares.)

For token trees (`--speculative-eagle-topk` > 1), `continuations` gathers what followed several
earlier occurrences of the matched suffixes and `trie_tree` merges them into one tree."""
from __future__ import annotations

import heapq

import numpy as np


class NgramIndex:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._arr = np.empty(256, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: list[int]) -> None:
        n0, n1 = len(self.tokens), len(self.tokens) + len(new)
        if n1 > len(self._arr):
            grown = np.empty(max(n1, 2 * len(self._arr)), dtype=np.int64)
            grown[:n0] = self._arr[:n0]
            self._arr = grown
        self._arr[n0:n1] = new
        self.tokens.extend(new)

    def _ends(self) -> list[np.ndarray]:
        """masks[n - 1][i]: whether the n tokens ending at position i + n - 1 equal the history's
        last n tokens, for ends before the last token (an occurrence must be followed by one);
        n = 1 .. max_n as far as the history allows."""
        L = len(self.tokens)
        a = self._arr[:L]
        if L < 2:
            return []
        mask = a[:L - 1] == a[L - 1]
        masks = [mask]
        for n in range(2, min(self.max_n, L - 1) + 1):
            mask = mask[1:] & (a[:L - n] == a[L - n])
            masks.append(mask)
        return masks

    def match(self, k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the latest earlier occurrence of the longest matching
        suffix, that suffix's length n); ([], 0) when nothing matches."""
        masks = self._ends()
        for n in range(len(masks), self.min_n - 1, -1):
            hits = np.flatnonzero(masks[n - 1])
            if hits.size:
                end = int(hits[-1]) + n - 1
                return self.tokens[end + 1:end + 1 + k], n
        return [], 0

    def continuations(self, k: int, limit: int) -> tuple[list[list[int]], int]:
        """(up to `limit` continuations of up to k tokens, the longest matched suffix length):
        the longest suffix's occurrences first, latest first, then shorter suffixes' (a
        continuation already seen is not repeated). The first is `match(k)`'s."""
        toks = self.tokens
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        longest = 0
        masks = self._ends()
        for n in range(len(masks), self.min_n - 1, -1):
            for i in np.flatnonzero(masks[n - 1])[::-1].tolist():
                end = i + n - 1
                cont = toks[end + 1:end + 1 + k]
                longest = longest or n
                if tuple(cont) not in seen:
                    seen.add(tuple(cont))
                    out.append(cont)
                if len(out) >= limit:
                    return out, longest
        return out, longest


def trie_tree(continuations: list[list[int]], *, budget: int, max_depth: int,
              topk: int) -> tuple[list[int], list[int]]:
    """(token_ids, parents) of one tree merging the continuations: the first one is laid as
    the spine (what a chain would draft), then trie nodes by how many continuations pass
    through them (earlier continuations win ties), at most `topk` children a node. Nodes come
    out parents first, the spine first, so any prefix is a tree. Best first is the best node
    set when no node has more than `topk` candidate children (a child never counts more than
    its parent); where `topk` binds, a heavier child can hide a deeper branch, and an exact
    choice (a knapsack over the trie) would cost more than the step it saves."""
    trie: dict[tuple[int, ...], list[int]] = {}          # path -> [count, first continuation using it]
    for rank, cont in enumerate(continuations):
        for d in range(1, min(len(cont), max_depth) + 1):
            entry = trie.setdefault(tuple(cont[:d]), [0, rank])
            entry[0] += 1
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, ...], int] = {(): -1}
    kids: dict[tuple[int, ...], int] = {}

    def add(path: tuple[int, ...]) -> None:
        index[path] = len(tokens)
        tokens.append(path[-1])
        parents.append(index[path[:-1]])
        kids[path[:-1]] = kids.get(path[:-1], 0) + 1

    spine = continuations[0][:min(max_depth, budget)] if continuations else []
    for d in range(1, len(spine) + 1):
        add(tuple(spine[:d]))
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for path in trie:
        children.setdefault(path[:-1], []).append(path)
    heap = [(-trie[p][0], trie[p][1], p) for p in trie if len(p) == 1 and p not in index]
    for d in range(1, len(spine) + 1):
        parent = tuple(spine[:d])
        heap += [(-trie[p][0], trie[p][1], p) for p in children.get(parent, ()) if p not in index]
    heapq.heapify(heap)
    while heap and len(tokens) < budget:
        _, _, path = heapq.heappop(heap)
        if kids.get(path[:-1], 0) >= topk:
            continue
        add(path)
        for child in children.get(path, ()):
            heapq.heappush(heap, (-trie[child][0], trie[child][1], child))
    return tokens, parents


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """One-off lookup over a whole history (the index built and thrown away)."""
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index.match(k)[0]
