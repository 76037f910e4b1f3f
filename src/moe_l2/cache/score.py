"""How well next-layer guesses did: `Score` (precision and recall against what the router picked) and
`prefetch_rates` (from the prefetch counters clients send, protocol.PREFETCH_COUNTERS). Standard library only:
`moe-l2 stats` shows them without numpy."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class Score:
    """Guesses against what the router picked: precision = right / guessed, recall = right / picked."""

    guessed: int = 0
    picked: int = 0
    right: int = 0

    def add(self, guesses: Iterable[int], picked: Iterable[int]) -> None:
        g, p = set(guesses), set(picked)
        self.guessed += len(g)
        self.picked += len(p)
        self.right += len(g & p)

    @property
    def precision(self) -> float | None:
        return self.right / self.guessed if self.guessed else None

    @property
    def recall(self) -> float | None:
        return self.right / self.picked if self.picked else None

    def as_dict(self) -> dict:
        return {"guessed": self.guessed, "picked": self.picked, "right": self.right,
                "precision": self.precision, "recall": self.recall}


def prefetch_rates(c: dict) -> dict:
    """From prefetch counters (protocol.PREFETCH_COUNTERS): the guesses' precision and recall, and the stall
    hidden. The worker's time on experts that were then demanded is time the forward did not wait for them:
    an estimate (every load is taken to cost the same), less the time fetches waited for the worker."""
    per_load = c["worker_us"] / c["issued"] if c["issued"] else 0.0
    score = Score(c["guessed"], c["picked"], c["right"])
    return {"precision": score.precision, "recall": score.recall,
            "hidden_s": max(0.0, per_load * c["useful"] - c["wait_us"]) / 1e6}
