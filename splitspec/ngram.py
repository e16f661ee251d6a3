"""Prompt lookup (vLLM's `ngram`, transformers' `prompt_lookup_num_tokens`): the continuation of
the most recent earlier occurrence of the sequence's last n tokens, longest n first.

`NgramIndex` keeps, per n, the starts of every n-gram that is followed by at least one token
(latest last), updated as tokens arrive: a lookup costs O(max_n) instead of a scan of the
history, which matters when the gateway asks before every step of every request.

For token trees (`--speculative-eagle-topk` > 1), `continuations` gathers what followed several
earlier occurrences of the matched suffixes and `trie_tree` merges them into one tree."""
from __future__ import annotations

import heapq


class NgramIndex:
    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._starts: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_n + 1)]

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: list[int]) -> None:
        toks = self.tokens
        for tok in new:
            j = len(toks)          # `tok` now follows the n-grams that end at j - 1
            for n in range(self.min_n, min(self.max_n, j) + 1):
                self._starts[n].setdefault(tuple(toks[j - n:j]), []).append(j - n)
            toks.append(tok)

    def match(self, k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the latest earlier occurrence of the longest matching
        suffix, that suffix's length n); ([], 0) when nothing matches."""
        toks, L = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            starts = self._starts[n].get(tuple(toks[L - n:]))
            if starts:
                return toks[starts[-1] + n:starts[-1] + n + k], n
        return [], 0

    def continuations(self, k: int, limit: int) -> tuple[list[list[int]], int]:
        """(up to `limit` continuations of up to k tokens, the longest matched suffix length):
        the longest suffix's occurrences first, latest first, then shorter suffixes' (a
        continuation already seen is not repeated). The first is `match(k)`'s."""
        toks, L = self.tokens, len(self.tokens)
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        longest = 0
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            for start in reversed(self._starts[n].get(tuple(toks[L - n:]), ())):
                cont = toks[start + n:start + n + k]
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
    out parents first, the spine first, so any prefix is a tree."""
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
