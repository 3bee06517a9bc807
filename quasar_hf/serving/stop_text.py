"""Stop strings left out of the text a client receives, as OpenAI's API does.

Decoding stops on the token that completes a stop string (Transformers' `StopStringCriteria`), so
the decoded text ends with it. `StopTextFilter` sits between the token stream and the client: it
holds back any tail that could still grow into a stop string, and once one appears it passes only
the text before it.
"""

from __future__ import annotations


class StopTextFilter:
    """Streamed text with stop strings cut: `feed(text)` returns what may be sent now, `finish()` the rest."""

    def __init__(self, stop_strings: list[str] | str | None) -> None:
        stops = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or [])
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.held += text
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.held, self.stopped = self.held[:cut], "", True
            return out
        keep = self._possible_start(self.held)
        out, self.held = self.held[:keep], self.held[keep:]
        return out

    def finish(self) -> str:
        out, self.held = self.held, ""
        return "" if self.stopped else out

    def _possible_start(self, text: str) -> int:
        """Index of the earliest suffix of `text` that is a proper prefix of some stop string (len(text) if none)."""
        for start in range(max(0, len(text) - max(len(s) for s in self.stops) + 1), len(text)):
            tail = text[start:]
            if any(s.startswith(tail) for s in self.stops):
                return start
        return len(text)


def cut_at_stop(text: str, stop_strings: list[str] | str | None) -> str:
    """The whole text up to its first stop string (non-streamed responses)."""
    cut = StopTextFilter(stop_strings)
    return cut.feed(text) + cut.finish()
