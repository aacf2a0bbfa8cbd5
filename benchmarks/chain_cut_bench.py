"""`specdec bench` with extra methods ``hybrid_head_gX``: the default hybrid (suffix copy, else the
head under adaptive k) with the head chain cut at score X (``HeadProposer(min_score=X)``; X = 0:
never cut), so that cuts are compared side by side with plain and the default in one run, methods
alternating prompt by prompt (docs/BENCHMARKS.md §5). Every other argument goes to `specdec bench`.

    .venv/bin/python benchmarks/chain_cut_bench.py --cuts 0,0.35 \\
        --methods plain,hybrid_head_g0,hybrid_head,hybrid_head_g0.35 --out bench-cuts
    .venv/bin/python benchmarks/paired.py bench-cuts/runs.jsonl --base hybrid_head_g0 --methods hybrid_head
"""

from __future__ import annotations

import argparse
import sys

import specdec.speculation as speculation
from specdec.bench import jobs
from specdec.cli import main as specdec_main
from specdec.proposers import HeadProposer, HybridProposer


def add_cut_methods(cuts: list[float]) -> list[str]:
    """Register ``hybrid_head_gX`` for each cut X with the bench and the method table."""
    names = {}
    for cut in cuts:
        def build(gen, config, capacity, cut=cut):
            return HybridProposer(speculation.copy_lookup(gen, config.ngram),
                                  HeadProposer(gen.draft_head(), capacity, min_score=cut))

        name = f"hybrid_head_g{cut:g}"
        speculation.METHODS[name.replace("_", "-")] = speculation.Method(
            f"the default hybrid, head chains cut at {cut:g}", build, needs_head=True, uses_lookup=True)
        jobs.ALL_METHODS.append(name)
        names[name] = cut
    method_spec = jobs._method_spec

    def spec(method: str, k_fixed: int):
        return (method.replace("_", "-"), "auto") if method in names else method_spec(method, k_fixed)

    jobs._method_spec = spec
    return list(names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuts", required=True, help="comma-separated chain cuts in [0, 1], e.g. 0,0.35")
    args, rest = ap.parse_known_args()
    cuts = [float(c) for c in args.cuts.split(",")]
    if not all(0 <= c <= 1 for c in cuts):
        ap.error(f"--cuts must lie in [0, 1], got {args.cuts}")
    add_cut_methods(cuts)
    sys.exit(specdec_main(["bench", *rest]))


if __name__ == "__main__":
    main()
