"""Stop strings over streamed text. A stop string may straddle chunks, so the matcher holds
back the longest tail of the text that could still become one (a prefix of some stop
string) and releases it once it cannot. Output ends before the earliest stop string; the
stop string itself is never emitted."""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops=()):
        self.stops = [s for s in stops if s]
        self.buffer = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add text; return what can be emitted now. After a match `stopped` is True and
        everything from the stop string on is dropped."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        self.buffer += text
        hit = self._first_hit()
        # Text that could still become a stop string starting earlier than the hit (or than
        # anything, without a hit) is held back: a longer stop may yet start before it.
        held = len(self.buffer) - self._partial_len()
        if hit is not None and hit <= held:
            out = self.buffer[:hit]
            self.buffer, self.stopped = "", True
            return out
        out, self.buffer = self.buffer[:held], self.buffer[held:]
        return out

    def _first_hit(self) -> int | None:
        hits = [i for i in (self.buffer.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _partial_len(self) -> int:
        """Length of the longest suffix of the buffer that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.buffer)), best, -1):
                if self.buffer.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """End of generation: a stop string held back behind a possible longer one is final now;
        otherwise the held-back tail is ordinary text."""
        hit = self._first_hit() if self.stops else None
        out, self.buffer = (self.buffer if hit is None else self.buffer[:hit]), ""
        self.stopped = self.stopped or hit is not None
        return out
