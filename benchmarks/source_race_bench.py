"""`specdec bench` with a hybrid that races its two sources where the lookup matches, side by
side with the default in one run, methods alternating prompt by prompt (docs/BENCHMARKS.md §2,
'A source race for the hybrid: measured, not adopted'):

* ``hybrid_head`` — the default: the suffix copy whenever every row's lookup matches, else the
  head, under adaptive k;
* ``hybrid_head_race`` — the same, except that where the lookup matches it runs whichever source
  has committed more tokens per second at such steps (:class:`RacingHybrid`).

Why it was tried: on the bench's greedy answers the lookup's matches draft worse than the head in
multi_turn and, when short, in math (`benchmarks/lookup_replay.py`). The method is registered in
:data:`specdec.speculation.METHODS` (the documented way to add one). Every argument goes to
`specdec bench`.

    .venv/bin/python benchmarks/source_race_bench.py --methods plain,hybrid_head,hybrid_head_race \\
        --temperature 0,0.7 --out bench-race
    .venv/bin/python benchmarks/paired.py bench-race/runs.jsonl --base hybrid_head --methods hybrid_head_race
"""

from __future__ import annotations

import sys
from time import perf_counter

import specdec.speculation as speculation
from specdec.adaptive import ShapeRace
from specdec.cli import main as specdec_main
from specdec.proposers import HybridProposer


class RacingHybrid(HybridProposer):
    """A :class:`HybridProposer` that, at steps where every row's lookup matches, drafts with the
    lookup or the model draft, whichever has committed more tokens per second at such steps. The
    race is the engine's two-arm :class:`~specdec.adaptive.ShapeRace` (False: the lookup, tried
    first; True: the model draft): each arm tried once, then the faster, and every 8th matched
    step the other. A step runs from ``propose`` to the end of ``observe`` (drafting, the target
    call, verification, the KV commit). Steps without a match draft as before and teach it nothing."""

    def __init__(self, lookup_side, model_draft) -> None:
        super().__init__(lookup_side, model_draft)
        self.race = ShapeRace()
        self._arm: bool | None = None  # this step's arm, at a matched step
        self._start = 0.0
        self._choice = "draft"
        self._asked: list[list[int]] | None = None  # the step's pending list the choice was made for

    def next_source(self, pending: list[list[int]]) -> str:
        if self._asked is not pending:  # the step's first ask (the engine's, or propose's)
            self._asked = pending
            matched = super().next_source(pending) == "ngram"
            self._arm = self.race.choose() if matched else None
            self._choice = "draft" if not matched or self._arm else "ngram"
        return self._choice

    def propose(self, pending, k, tree=False):
        self._start = perf_counter()
        proposal = super().propose(pending, k, tree)  # (it asks next_source: the step's choice)
        self._asked = None
        return proposal

    def observe(self, num_accepted, target_hidden=None) -> None:
        super().observe(num_accepted, target_hidden=target_hidden)
        if self._arm is not None:
            self.race.observe(self._arm, int(num_accepted.sum()) + len(num_accepted), perf_counter() - self._start)
            self._arm = None


def add_race() -> str:
    """Register ``hybrid_head_race``; returns the bench's name for it."""

    def build(gen, config, capacity):
        return RacingHybrid(speculation.copy_lookup(gen, config.ngram), speculation.METHODS["head"].build(gen, config, capacity))

    speculation.METHODS["hybrid-head-race"] = speculation.Method(
        "the default hybrid, racing lookup and head where the lookup matches", build, needs_head=True, uses_lookup=True)
    return "hybrid_head_race"


def main() -> None:
    add_race()
    sys.exit(specdec_main(["bench", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
