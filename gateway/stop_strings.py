"""Stop strings on a detokenized stream: the gateway's part of the stop rule (it has the text)."""

from __future__ import annotations


class StopStringMatcher:
    """Applies stop strings to a text stream without ever emitting part of a stop string.

    Text that could be the beginning of a stop string is held back until the next
    delta decides it. Because of that, a match can only start inside the held text
    plus the new delta, so only that window is searched.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped: str | None = None  # the stop string that matched

    def _held_suffix_len(self, text: str) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def feed(self, delta: str, check: bool = True) -> tuple[str, bool]:
        """-> (text safe to emit now, whether a stop string matched). After a match, text up to
        the stop string (excluded) is returned and everything after it is dropped."""
        if not self.stops:
            return delta, False
        buf = self.pending + delta
        if check:
            hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
            if hits:
                i, s = min(hits)
                self.stopped, self.pending = s, ""
                return buf[:i], True
        hold = self._held_suffix_len(buf)
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        """The sequence ended without a match: the held text is just text."""
        out, self.pending = self.pending, ""
        return out
