"""`specdec bench` with extra methods that vary the head chain's confidence cut, side by side with
plain and the default in one run, methods alternating prompt by prompt (docs/BENCHMARKS.md §5):

* ``hybrid_head_gX`` — the default hybrid (suffix copy, else the head under adaptive k) with the
  head chain cut at score X (``HeadProposer(min_score=X)``; X = 0: never cut);
* ``hybrid_head_gX_silent`` — the same cut, but its proposals do not declare it
  (``Proposal.declined``), so adaptive k learns nothing from a cut position: the default of
  stop 41, before cuts were counted as rejected drafts.

The methods are registered in :data:`specdec.speculation.METHODS` (the documented way to add one),
which `specdec bench` runs with adaptive k. Every other argument goes to `specdec bench`.

    .venv/bin/python benchmarks/chain_cut_bench.py --cuts 0 --silent 0.2 \\
        --methods plain,hybrid_head_g0,hybrid_head_g0.2_silent,hybrid_head --out bench-cuts
    .venv/bin/python benchmarks/paired.py bench-cuts/runs.jsonl --base hybrid_head_g0.2_silent --methods hybrid_head
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import specdec.speculation as speculation
from specdec.cli import main as specdec_main
from specdec.proposers import HeadProposer, HybridProposer


class SilentCutHead(HeadProposer):
    """A :class:`HeadProposer` whose cut chains do not say they were cut."""

    def propose(self, pending, k, tree=False):
        return dataclasses.replace(super().propose(pending, k, tree), declined=False)


def add_cut_methods(cuts: list[float], silent: list[float] = ()) -> list[str]:
    """Register ``hybrid_head_gX`` for each of ``cuts`` and ``hybrid_head_gX_silent`` for each of
    ``silent``; returns the bench's names for them."""
    names = []
    for cut, quiet in [(c, False) for c in cuts] + [(c, True) for c in silent]:
        head = SilentCutHead if quiet else HeadProposer

        def build(gen, config, capacity, cut=cut, head=head):
            return HybridProposer(speculation.copy_lookup(gen, config.ngram), head(gen.draft_head(), capacity, min_score=cut))

        name = f"hybrid_head_g{cut:g}" + ("_silent" if quiet else "")
        what = f"the default hybrid, head chains cut at {cut:g}" + (" (cuts not declared to adaptive k)" if quiet else "")
        speculation.METHODS[name.replace("_", "-")] = speculation.Method(what, build, needs_head=True, uses_lookup=True)
        names.append(name)
    return names


def _cuts(text: str | None, ap: argparse.ArgumentParser, flag: str) -> list[float]:
    cuts = [float(c) for c in text.split(",")] if text else []
    if not all(0 <= c <= 1 for c in cuts):
        ap.error(f"{flag} must lie in [0, 1], got {text}")
    return cuts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuts", default=None, help="comma-separated chain cuts in [0, 1], e.g. 0,0.35")
    ap.add_argument("--silent", default=None, help="comma-separated cuts to add as hybrid_head_gX_silent")
    args, rest = ap.parse_known_args()
    add_cut_methods(_cuts(args.cuts, ap, "--cuts"), _cuts(args.silent, ap, "--silent"))
    sys.exit(specdec_main(["bench", *rest]))


if __name__ == "__main__":
    main()
